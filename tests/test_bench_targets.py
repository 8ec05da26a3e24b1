"""The GPU issue's targets as ``bench fig2`` and ``bench lm`` print them: each a line ending in
ok, MISSED or n/a (with why), from the records' own numbers."""

from sparseffn.bench import fig2, lm_step


def fig2_record(d_model=1024, over_dense=0.4, ms=None, speedups=None, peaks=None,
                compile="none"):
    ms = {"sparseffn": 1.0, "dense_param": 1.0 / over_dense, **(ms or {})}
    return {"d_model": d_model, "tokens": 32768, "device": "cuda:0", "dtype": "bfloat16",
            "compile": compile, "ms": ms, "over_dense_param": {"sparseffn": over_dense},
            "speedup_over": speedups or {},
            "peak_mib": {"sparseffn": None, **(peaks or {})}}


def verdicts(lines, about):
    return [line.rsplit(": ", 1)[1] for line in lines if about in line]


def test_fig2_checks_the_ratio_to_dense_at_the_three_widths_the_issue_names():
    lines = fig2.check_targets([fig2_record(512, 1.0), fig2_record(1024, 0.51),
                                fig2_record(2048, 0.19), fig2_record(768, 0.1)])
    assert "this run: cuda:0, bfloat16, 32768 tokens, compile none" in lines[0]
    assert verdicts(lines, "dense_param <=") == ["ok", "MISSED", "ok"]
    assert "<= 0.5 at d_model 1024: 0.51: MISSED" in "\n".join(lines)


def test_fig2_measures_the_speedup_against_the_faster_of_the_two_reference_peers():
    # ScatterMoE is the faster peer (2 ms against 3): the 2x is asked against it alone
    faster = {"scattermoe": 2.0, "csordas_cvmm": 3.0}
    lines = fig2.check_targets([fig2_record(ms=faster, speedups={"scattermoe": 1.9,
                                                                 "csordas_cvmm": 3.0})])
    assert verdicts(lines, ">= 2x as fast") == ["MISSED"]
    assert "scattermoe 1.90x" in "\n".join(lines)
    lines = fig2.check_targets([fig2_record(ms=faster, speedups={"scattermoe": 2.0,
                                                                 "csordas_cvmm": 3.0,
                                                                 "grouped_mm": 0.5})])
    assert verdicts(lines, ">= 2x as fast") == ["ok"]
    lines = fig2.check_targets([fig2_record(speedups={"grouped_mm": 5.0})])
    assert verdicts(lines, ">= 2x as fast") == ["n/a (neither was timed)"]


def test_fig2_peak_memory_is_compared_only_where_the_allocator_saw_both():
    both = {"sparseffn": 400.0, "scattermoe": 439.0}
    assert verdicts(fig2.check_targets([fig2_record(peaks=both)]), "peak MiB") == ["ok"]
    assert verdicts(fig2.check_targets([fig2_record(peaks={**both, "sparseffn": 440.0})]),
                    "peak MiB") == ["MISSED"]
    assert verdicts(fig2.check_targets([fig2_record(peaks=both, compile="reduce-overhead")]),
                    "peak MiB") == ["n/a (CUDA graphs allocate at capture; time it eagerly)"]
    assert verdicts(fig2.check_targets([fig2_record(peaks={"sparseffn": 400.0})]),
                    "peak MiB") == ["n/a (scattermoe was not timed)"]
    assert verdicts(fig2.check_targets([fig2_record()]), "peak MiB") == \
        ["n/a (no peak from the CUDA allocator)"]


def test_fig2_says_when_sonic_moe_was_not_there_to_compare_with():
    lines = fig2.check_targets([fig2_record()])
    assert verdicts(lines, "sonic_moe") == ["n/a (not among the peers timed)"]
    lines = fig2.check_targets([fig2_record(speedups={"sonic_moe": 1.2}),
                                fig2_record(2048, speedups={"sonic_moe": 0.9})])
    assert verdicts(lines, "sonic_moe") == ["ok", "MISSED"]
    assert fig2.check_targets([]) == []


def lm_record(preset, over_dense, compiled=True, compile="reduce-overhead"):
    return {"preset": preset, "over_dense": over_dense, "device": "cuda:0",
            "dtype": "bfloat16", "compile": compile, "compiled": compiled}


def test_lm_checks_each_named_preset_against_its_own_limit():
    records = [lm_record("dense", 1.0), lm_record("sigma_moe", 1.0), lm_record("switch", 1.01),
               lm_record("glam", 3.0), lm_record("pkm", 1.5), lm_record("peer", 1.51)]
    lines = lm_step.check_targets(records)
    assert "this run: cuda:0, bfloat16, compile reduce-overhead" in lines[0]
    assert [line.split(" /")[0] for line in lines[1:]] == \
        ["target: sigma_moe", "target: switch", "target: pkm", "target: peer"]
    assert verdicts(lines, "target:") == ["ok", "MISSED", "ok", "MISSED"]
    assert "switch / dense <= 1.0: 1.01: MISSED" in lines[2]
    assert "pkm / dense <= 1.5" in lines[3]
    assert lm_step.check_targets([lm_record("dense", 1.0)]) == []


def test_lm_marks_a_preset_timed_eagerly_when_compilation_was_asked_for():
    (_, line) = lm_step.check_targets([lm_record("fff", 0.9, compiled=False)])
    assert "(timed eagerly: it did not compile)" in line and line.endswith("ok")
    (_, line) = lm_step.check_targets([lm_record("fff", 0.9, compiled=False, compile="none")])
    assert "eagerly" not in line


def test_the_tables_end_with_their_targets():
    record = {**lm_record("sigma_moe", 1.2), "total_params": 10, "active_params": 5,
              "flops_per_token": 1e6, "ms": 1.0, "tokens_per_s": 1.0, "peak_mib": None}
    assert lm_step.format_table([record]).splitlines()[-1] == \
        "target: sigma_moe / dense <= 1.0: 1.20: MISSED"
    table = fig2.format_table([fig2_record(512, 1.27)])
    assert "target: sparseffn / dense_param <= 1.0 at d_model 512: 1.27: MISSED" in table
