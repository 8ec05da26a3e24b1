# The two commands of the README. Both set everything up first (scripts/setup.sh is
# re-runnable and skips what is already done).
VENV := .venv
BIN := $(VENV)/bin

.PHONY: compare bench test setup peers routers productkeys clean

# Main job: a byte-level Transformer LM on Python's own documentation (no download) with every
# FFN (sigma-MoE, Switch, FFF, PKM, PEER) at equal parameters beside the dense models with the same
# parameters and with sigma-MoE's compute; writes
# runs/compare_pydoc/report.md and its plots.
compare:
	@EXTRAS=test bash scripts/setup.sh
	$(BIN)/sparseffn compare experiments/compare_pydoc.toml

# The layer benchmark (sigma-MoE vs parameter-equal and active-equal dense MLPs).
bench:
	@EXTRAS=test bash scripts/setup.sh
	$(BIN)/sparseffn bench layers --json runs/bench_layers.json

# The test suite, one pytest-xdist worker per core (tests/conftest.py gives each worker its
# share of the cores' threads); worksteal keeps the last minutes from waiting on one worker.
test:
	@EXTRAS=test bash scripts/setup.sh
	$(BIN)/python -m pytest -n auto --dist worksteal

setup:
	@EXTRAS=test bash scripts/setup.sh

# The layer benchmark with the other MoE implementations (DeepSpeed, st-moe-pytorch, ...).
peers:
	@EXTRAS=test,peers bash scripts/setup.sh
	$(BIN)/sparseffn bench layers --peers --json runs/bench_layers_peers.json

# The router benchmark of Chaunin & Mikhailovskiy, "Matrix Mixture of Experts is the Best
# Fast Feed-Forward" (Table 2, Figure 3): FFF formulations vs MoE, depths 1-13.
routers:
	@EXTRAS=test bash scripts/setup.sh
	$(BIN)/sparseffn bench routers --json runs/bench_routers.json --plot runs/bench_routers.png

# Product keys: retrieval scaling, PEER with a million experts and PKM next to peer-pytorch and
# product-key-memory (both in the test extra), and a million-expert training run.
productkeys:
	@EXTRAS=test bash scripts/setup.sh
	$(BIN)/sparseffn bench productkeys --json runs/bench_productkeys.json --plot runs/bench_productkeys.png

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
