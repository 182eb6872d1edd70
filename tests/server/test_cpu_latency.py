"""The CPU latency QoS request (``--cpu-latency-qos-us``): held while requests run and a linger after, released
at shutdown, refused at start-up when it cannot be honoured; against the kernel's own file where this process may
write it."""

from __future__ import annotations

import asyncio
import logging
import os
import struct

import pytest

from server.cpu_latency import DEVICE, NO_BOUND, CpuLatencyQos
from server.settings import Settings
from txlserve.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _file_opener(path):
    """Opens a regular file in place of the device (what was written stays readable)."""
    path.write_bytes(b"")
    return lambda _device, flags: os.open(path, flags)


async def turns_until(qos: CpuLatencyQos, held: bool) -> None:
    """Loop iterations (not time) until ``qos.held`` is ``held``: a run's done callback, then a linger of 0."""
    for _ in range(100):  # loop iterations, not time: a linger of 0 fires on the next one
        if qos.held == held:
            return
        await asyncio.sleep(0)


def test_the_start_up_check_writes_a_request_that_bounds_nothing(tmp_path):
    target = tmp_path / "qos"
    qos = CpuLatencyQos(0, opener=_file_opener(target))
    qos.check()  # a file that opens but refuses writes would fail here, not at the first request
    assert struct.unpack("i", target.read_bytes()) == (NO_BOUND,) and not qos.held


def test_nothing_is_opened_unless_asked(tmp_path):
    opened = []
    qos = CpuLatencyQos(None, opener=lambda *a: opened.append(a) or os.open(tmp_path / "x", os.O_CREAT))
    qos.check()

    async def main() -> None:
        qos.busy()
        qos.idle()

    asyncio.run(main())
    assert opened == [] and not qos.held


def test_held_while_requests_run_and_a_linger_after(tmp_path):
    async def main() -> None:
        target = tmp_path / "qos"
        qos = CpuLatencyQos(5, opener=_file_opener(target), linger_s=0)
        qos.busy()
        qos.busy()  # overlapping requests share one hold
        assert qos.held and qos.holds == 1 and struct.unpack("i", target.read_bytes()) == (5,)
        qos.idle()
        await asyncio.sleep(0)
        assert qos.held  # one request still runs
        qos.idle()
        await turns_until(qos, held=False)
        assert not qos.held and qos.holds == 1
        qos.busy()  # the next request holds it again
        assert qos.held and qos.holds == 2
        qos.idle()
        qos.close()

        slow = CpuLatencyQos(0, opener=_file_opener(tmp_path / "slow"), linger_s=60)
        slow.busy()
        slow.idle()
        assert slow.held  # lingering: a stream's next request comes back long before 60 s
        slow.busy()  # ... and comes back: the release is called off
        slow.idle()
        assert slow.held and slow.holds == 1
        slow.close()  # shutdown lets it go at once
        assert not slow.held and slow._release is None

    asyncio.run(main())


def test_a_refused_open_is_one_line_at_start_up_and_a_warning_later(tmp_path, caplog):
    def refuse(error):
        def opener(*_):
            raise error
        return opener

    with pytest.raises(ConfigError, match="run the server as root or give its user write access"):
        CpuLatencyQos(0, opener=refuse(PermissionError(13, "Permission denied"))).check()
    with pytest.raises(ConfigError, match="No such file"):
        CpuLatencyQos(0, opener=refuse(FileNotFoundError(2, "No such file or directory"))).check()

    async def main() -> None:
        caplog.set_level(logging.WARNING, logger="txlserve")
        qos = CpuLatencyQos(0, opener=refuse(PermissionError(13, "Permission denied")))
        qos.busy()  # requests run as they would without it
        qos.busy()
        assert not qos.held and caplog.text.count("could not hold the CPU latency QoS request") == 1  # once
        qos.idle()
        qos.idle()
        read_only = tmp_path / "ro"
        read_only.write_bytes(b"")
        opened = []
        fails = CpuLatencyQos(0, opener=lambda *_: opened.append(os.open(read_only, os.O_RDONLY)) or opened[-1])
        fails.busy()  # the write fails: the file is closed again, nothing held
        assert not fails.held and opened
        with pytest.raises(OSError):
            os.fstat(opened[0])
        with pytest.raises(ConfigError):  # and the start-up check would have refused it
            fails.check()

    asyncio.run(main())


def test_the_setting():
    assert Settings().cpu_latency_qos_us is None
    assert Settings.from_env({"TXLSERVE_CPU_LATENCY_QOS_US": "0"}).cpu_latency_qos_us == 0
    assert Settings.from_env({"TXLSERVE_CPU_LATENCY_QOS_US": ""}).cpu_latency_qos_us is None
    for bad in (-1, 2_000_000_001):
        with pytest.raises(ConfigError, match="cpu_latency_qos_us"):
            Settings(cpu_latency_qos_us=bad)


def _kernel_value() -> int:
    with open(DEVICE, "rb") as f:  # reading gives the bound in force, whoever asked for it
        return struct.unpack("i", f.read(4))[0]


@pytest.mark.skipif(not os.access(DEVICE, os.W_OK), reason=f"{DEVICE} is not writable here (not root, or not Linux)")
def test_the_kernel_holds_the_bound_while_held_and_drops_it_after():
    before = _kernel_value()
    if before <= 7:
        pytest.skip(f"another process holds a bound of {before} us: this one's cannot be seen")

    async def main() -> None:
        qos = CpuLatencyQos(7)
        qos.check()
        qos.busy()
        try:
            assert _kernel_value() == min(before, 7)
        finally:
            qos.close()

    asyncio.run(main())
    assert _kernel_value() == before
