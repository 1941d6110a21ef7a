"""Report headers name the machine well enough to tell two CPUs of one brand name apart, and the command with
the environment settings that change what it computes."""

from __future__ import annotations

from dspark.report import cpu_info, machine_line

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 avx512f avx512_bf16

processor\t: 1
model name\t: another
"""


def test_cpu_info_reads_the_first_processor_its_generation_and_vector_extensions():
    assert cpu_info(CPUINFO) == {"cpu": "AMD EPYC", "cpu_id": "family 25, model 17", "isa": "avx2 avx512f avx512_bf16"}
    assert cpu_info("model name : Some CPU\n") == {"cpu": "Some CPU"}
    assert cpu_info("") == {"cpu": ""}


def test_machine_line_lists_what_is_known():
    assert machine_line({"cpu": "AMD EPYC", "cores": 2}) == "AMD EPYC (2 cores)"
    assert machine_line({"cpu": "X", "cpu_id": "family 6, model 143", "isa": "amx_bf16", "cores": 16,
                         "gpu": "NVIDIA H100"}) == "X (family 6, model 143; amx_bf16; 16 cores; NVIDIA H100)"


def test_the_command_names_the_settings_that_change_a_run(monkeypatch):
    from dspark.report import command_line

    monkeypatch.setattr("sys.argv", ["dspark", "calibrate", "--out", "a b"])
    monkeypatch.delenv("DSPARK_DTYPE", raising=False)
    monkeypatch.delenv("DSPARK_PROFILE_DIR", raising=False)
    monkeypatch.setenv("DSPARK_API_KEY", "secret")
    assert command_line() == "dspark calibrate --out 'a b'"
    monkeypatch.setenv("DSPARK_DTYPE", "bfloat16")
    assert command_line() == "DSPARK_DTYPE=bfloat16 dspark calibrate --out 'a b'"
