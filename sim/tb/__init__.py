"""Harnesses, drivers, stimulus and device-under-test tops the benches (and the servers)
build on; no cocotb tests here."""
