"""A :class:`~sparseffn.models.lm.TransformerLM`'s decoding with a KV cache, exported to ONNX,
and generation from it in ONNX Runtime.

:func:`decoder_to_onnx` exports one program for the prompt and for every step after it
(:meth:`~sparseffn.models.lm.TransformerLM.forward_with_past`), the batch and the number of
new tokens dynamic. Its inputs and outputs (L blocks, H heads, C = the context, d = d_head,
in the model's float dtype):

========================  ====================  =============================================
``tokens``                int64 [batch, time]   the new tokens
``positions``             int64 [time]          their positions, in [0, C)
``past_keys.{i}``         [batch, H, C, d]      block i's keys of the positions before (read)
``past_values.{i}``       [batch, H, C, d]      and values; zeros where nothing was written
``logits``                [batch, time, vocab]  output
``new_keys.{i}``          [batch, H, time, d]   output: the new tokens' keys and values,
``new_values.{i}``        [batch, H, time, d]   which the caller stores at ``positions``
========================  ====================  =============================================

The program only reads the past: it attends to the past slots and to the new tokens side by
side (no copy of the cache per step), and the caller writes the new keys and values into its
own arrays in place. :class:`OnnxDecoder` is that caller, in NumPy: it keeps the cache,
feeds the prompt and then one token at a time, and draws tokens as
:func:`sparseffn.models.generate.generate` does (greedy, temperature, top-k, top-p; the same
``generator`` gives the same draws, to rounding). Past the context it runs the last
``context`` tokens, as ``generate`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .models.generate import (_blocked_by, cache_blocker, check_prompt, check_sampling,
                              draw_tokens)
from .models.kv_cache import first_position
from .onnx_export import require_onnxruntime

_ONNX_FLOAT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
                     "tensor(double)": np.float64}


class _DecodingStep(nn.Module):
    """forward(tokens, positions, past_keys, past_values) -> (logits, *new_keys,
    *new_values): :meth:`TransformerLM.forward_with_past` with flat outputs. (Lists, not
    ``*past``: PyTorch 2.9's export wrote guards on variadic arguments that did not run,
    "NameError: name 'L' is not defined".)"""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                past_keys: list[torch.Tensor], past_values: list[torch.Tensor]
                ) -> tuple[torch.Tensor, ...]:
        logits, keys, values = self.model.forward_with_past(tokens, positions, past_keys,
                                                            past_values)
        return (logits, *keys, *values)


def decoder_to_onnx(model: nn.Module, **onnx_options: Any) -> "torch.onnx.ONNXProgram":
    """The decoding program of ``model`` (a :class:`~sparseffn.models.lm.TransformerLM` in
    eval mode) for ONNX Runtime, its inputs and outputs named as the module docstring lists;
    returns the ``ONNXProgram`` (``.save(path)``). ``onnx_options`` go to
    ``torch.onnx.export`` (through :func:`sparseffn.to_onnx`).

    A ValueError for a model in training mode, and for one whose routing depends on the
    tokens evaluated together (an evaluation capacity, :func:`~sparseffn.models.generate.
    cache_blocker`): a cache would change its outputs."""
    from .models.lm import TransformerLM
    from .onnx_export import to_onnx
    if not isinstance(model, TransformerLM):
        raise TypeError(f"decoder_to_onnx exports a TransformerLM, got {type(model).__name__} "
                        f"(sparseffn.to_onnx exports any module without a cache)")
    if model.training:
        raise ValueError("decoder_to_onnx exports inference: call model.eval() first")
    blocker = cache_blocker(model)
    if blocker is not None:
        raise ValueError(f"decoder_to_onnx: {_blocked_by(blocker)}; export the model without "
                         f"a cache (sparseffn.to_onnx), which runs the window for each token")
    config, weight = model.config, model.embed.weight
    blocks, heads = len(model.blocks), config.n_heads
    batch = torch.export.Dim("batch", min=1)
    time = torch.export.Dim("time", min=1, max=config.context)
    example_time = min(3, config.context)
    tokens = torch.randint(0, config.vocab_size, (2, example_time), device=weight.device)
    positions = torch.arange(example_time, device=weight.device)
    keys, values = ([torch.zeros(2, heads, config.context, config.d_model // heads,
                                 dtype=weight.dtype, device=weight.device)
                     for _ in range(blocks)] for _ in range(2))
    dynamic = ({0: batch, 1: time}, {0: time}, [{0: batch}] * blocks, [{0: batch}] * blocks)
    names = [f"{kind}.{i}" for kind in ("keys", "values") for i in range(blocks)]
    onnx_options.setdefault("input_names",
                            ["tokens", "positions", *(f"past_{name}" for name in names)])
    onnx_options.setdefault("output_names", ["logits", *(f"new_{name}" for name in names)])
    return to_onnx(_DecodingStep(model).eval(), (tokens, positions, keys, values),
                   dynamic_shapes=dynamic, **onnx_options)


class OnnxDecoder:
    """Generation from a program :func:`decoder_to_onnx` wrote, in ONNX Runtime, the KV cache
    kept here in NumPy arrays (zeros at :meth:`reset`, each step's new keys and values written
    in place at their positions)::

        decoder = OnnxDecoder("decoder.onnx")
        tokens = decoder.generate(prompt, 100, temperature=0.8, top_p=0.95)

    ``program``: the file's path or an ``onnxruntime.InferenceSession`` (for its providers
    and options). The sizes (blocks, heads, context, vocabulary, dtype) are read from the
    program's inputs and outputs. :meth:`reset` and :meth:`step` are the lower level: a
    batch's cache, and the logits of tokens that continue it."""

    def __init__(self, program: str | Path | Any) -> None:
        if isinstance(program, (str, Path)):
            program = require_onnxruntime("OnnxDecoder").InferenceSession(str(program))
        self.session = program
        inputs = {value.name: value for value in program.get_inputs()}
        self._keys = sorted((name for name in inputs if name.startswith("past_keys.")),
                            key=lambda name: int(name.rsplit(".", 1)[1]))
        if "tokens" not in inputs or "positions" not in inputs or not self._keys:
            raise ValueError(f"OnnxDecoder: not a program of decoder_to_onnx (inputs: "
                             f"{', '.join(inputs)})")
        self._values = [name.replace("past_keys.", "past_values.") for name in self._keys]
        first = inputs[self._keys[0]]
        _, self.heads, self.context, self.head_dim = first.shape
        self.dtype = _ONNX_FLOAT_TYPES[first.type]
        logits, *new = [value.name for value in program.get_outputs()]
        # where each output goes: new_keys.{i} into past_keys.{i}, by name
        self._stored_as = [name.replace("new_", "past_", 1) for name in new]
        if sorted(self._stored_as) != sorted(self._keys + self._values):
            raise ValueError(f"OnnxDecoder: not a program of decoder_to_onnx (outputs: "
                             f"{', '.join([logits, *new])})")
        self.vocab_size = program.get_outputs()[0].shape[-1]
        self.batch = 0
        self.length = 0
        self._past: dict[str, np.ndarray] = {}

    @property
    def num_layers(self) -> int:
        return len(self._keys)

    def reset(self, batch: int) -> None:
        """An empty cache (zeros) for ``batch`` new sequences."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"OnnxDecoder.reset: batch must be a positive integer, got "
                             f"{batch!r}")
        shape = (batch, self.heads, self.context, self.head_dim)
        self._past = {name: np.zeros(shape, self.dtype) for name in self._keys + self._values}
        self.batch, self.length = batch, 0

    def step(self, tokens: torch.Tensor | np.ndarray) -> torch.Tensor:
        """The logits [batch, t, vocab] (a float32 tensor) of ``tokens`` (int64 [batch, t])
        continuing the sequences in the cache, at positions ``length, ..., length + t - 1``;
        their keys and values are added to the cache. A ValueError if they do not fit (another
        batch size, past the context); the cache is then unchanged."""
        if not self._past:
            raise ValueError("OnnxDecoder.step: no cache yet; call reset(batch) first")
        tokens = torch.as_tensor(tokens)
        check_prompt(tokens, self.vocab_size)
        start = first_position("OnnxDecoder", tokens, self.batch, self.length, self.context)
        t = tokens.shape[1]
        feeds = {"tokens": tokens.long().numpy(),
                 "positions": np.arange(start, start + t, dtype=np.int64), **self._past}
        logits, *new = self.session.run(None, feeds)
        for name, written in zip(self._stored_as, new):
            self._past[name][:, :, start:start + t] = written
        self.length = start + t
        return torch.from_numpy(logits).float()

    def generate(self, prompt: torch.Tensor | np.ndarray, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """``prompt`` (int64 [batch, T], T >= 1) followed by ``max_new_tokens`` drawn tokens,
        int64 [batch, T + max_new_tokens]: :func:`sparseffn.models.generate.generate`'s
        sampling, the prompt run at once into a new cache and each drawn token alone. Once
        the sequence fills the context, each token runs the last ``context`` tokens. An empty
        batch gives an empty batch, as ``generate`` does."""
        check_sampling(temperature, top_k, top_p, max_new_tokens)
        prompt = torch.as_tensor(prompt)
        check_prompt(prompt, self.vocab_size)
        if prompt.shape[0] == 0:          # no sequence: nothing to run
            return prompt.new_zeros(0, prompt.shape[1] + max_new_tokens, dtype=torch.long)

        def next_logits(tokens: torch.Tensor, step: int) -> torch.Tensor:
            if step == 0 or self.length >= self.context:    # the prompt, or the window
                self.reset(tokens.shape[0])
                return self.step(tokens[:, -self.context:])[:, -1]
            return self.step(tokens[:, -1:])[:, -1]

        return draw_tokens(prompt, max_new_tokens, next_logits, temperature, top_k, top_p,
                           generator)
