import platform

from tandem.common import cpuinfo

INTEL = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: a second processor is not read
flags\t\t: fpu
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes
CPU implementer\t: 0x41
"""


def test_the_first_processors_fields_are_read(monkeypatch):
    monkeypatch.setattr(cpuinfo, "cpu_fields", lambda: cpuinfo.parse_cpuinfo(INTEL))
    assert cpuinfo.cpu_model_name() == "Intel(R) Xeon(R) Platinum 8488C"
    assert cpuinfo.cpu_vendor_family() == ("GenuineIntel", 6)
    assert {"avx2", "avx512f", "amx_tile"} <= cpuinfo.cpu_flags() and "fpu" in cpuinfo.cpu_flags()


def test_a_cpu_without_x86_fields_answers_unknown(monkeypatch):
    for text in (ARM, ""):
        monkeypatch.setattr(cpuinfo, "cpu_fields", lambda text=text: cpuinfo.parse_cpuinfo(text))
        assert cpuinfo.cpu_model_name() == "unknown"
        assert cpuinfo.cpu_vendor_family() == ("", -1)
        assert cpuinfo.cpu_flags() == frozenset()


def test_this_machine_is_read():
    if platform.machine() in ("x86_64", "AMD64"):
        vendor, family = cpuinfo.cpu_vendor_family()
        assert vendor in ("AuthenticAMD", "GenuineIntel") and family > 0, (vendor, family)
        assert {"sse2", "avx"} <= cpuinfo.cpu_flags()
        assert cpuinfo.cpu_model_name() != "unknown"
