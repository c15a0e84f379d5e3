"""The tensorwire Python package against the Rust programs and itself: send from NumPy, receive
from the Rust sender, every dtype, .safetensors files, typed errors; on a GPU, PyTorch CUDA
tensors both ways with no copy.

The Rust programs come from TENSORWIRE_BIN_DIR (default: target/debug of this checkout).
GPU tests skip without PyTorch CUDA, and fail instead when TENSORWIRE_REQUIRE_GPU=1.
"""

import asyncio
import contextlib
import json
import os
import pathlib
import shutil
import struct
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest

import tensorwire
from tensorwire import Raw, TensorwireError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def program(name: str) -> str:
    path = pathlib.Path(os.environ.get("TENSORWIRE_BIN_DIR", ROOT / "target" / "debug")) / name
    if not path.exists():
        pytest.fail(f"{path} is missing: cargo build --bins, or set TENSORWIRE_BIN_DIR")
    return str(path)


class RustReceiver:
    """`receiver --listen 127.0.0.1:0 ARGS`, its address read from its first line."""

    def __init__(self, *args: str, env=None) -> None:
        self.proc = subprocess.Popen(
            [program("receiver"), "--listen", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        first = self.proc.stdout.readline()
        assert first.startswith("listening on "), first + self.proc.stderr.read()
        self.addr = first.split()[-1]
        self.port = int(self.addr.rsplit(":", 1)[1])
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait(self, timeout: float = 60) -> str:
        self.proc.wait(timeout)
        self._reader.join(timeout)
        return "".join(self.lines) + self.proc.stderr.read()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def dev_cert(self) -> str:
        return os.path.join(tempfile.gettempdir(), f"tensorwire-dev-{os.getuid()}", f"receiver-{self.addr.replace(':', '-')}.pem")


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def write_safetensors(path, tensors, metadata=None):
    """A .safetensors file of name → (dtype, shape, bytes)."""
    header, offset, blobs = {}, 0, []
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def sample_arrays():
    rng = np.random.default_rng(7)
    arrays = {
        "bool": rng.integers(0, 2, (3, 5)).astype(np.bool_),
        "u8": rng.integers(0, 255, (4, 4), dtype=np.uint8),
        "i8": rng.integers(-128, 127, 17, dtype=np.int8),
        "u16": rng.integers(0, 65535, (2, 3), dtype=np.uint16),
        "i16": rng.integers(-30000, 30000, 9, dtype=np.int16),
        "u32": rng.integers(0, 2**32 - 1, 5, dtype=np.uint32),
        "i32": rng.integers(-(2**31), 2**31 - 1, (2, 2, 2), dtype=np.int32),
        "u64": rng.integers(0, 2**63, 3, dtype=np.uint64),
        "i64": rng.integers(-(2**62), 2**62, 3, dtype=np.int64),
        "f16": rng.standard_normal((8, 2)).astype(np.float16),
        "f32": rng.standard_normal((16, 8)).astype(np.float32),
        "f64": rng.standard_normal(7),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    raw = {
        "bf16": Raw("BF16", (4, 2), rng.integers(0, 65535, 8, dtype=np.uint16).tobytes()),
        "fp8_e4m3": Raw("F8_E4M3", (6,), bytes(range(6))),
        "fp8_e5m2": Raw("F8_E5M2", (2, 2), bytes([1, 2, 250, 255])),
    }
    return arrays, raw


NUMPY_NAME = {"bool": "BOOL", "u8": "U8", "i8": "I8", "u16": "U16", "i16": "I16", "u32": "U32",
              "i32": "I32", "u64": "U64", "i64": "I64", "f16": "F16", "f32": "F32", "f64": "F64",
              "scalar": "F32", "empty": "F32"}


def test_numpy_arrays_of_every_dtype_land_bit_exact_in_the_rust_receiver(tmp_path):
    arrays, raw = sample_arrays()
    rx = RustReceiver("--device", "host", "--save", str(tmp_path), "--count", str(len(arrays) + len(raw)))
    try:
        results = tensorwire.send(rx.addr, {**arrays, **raw})
        assert sorted(r.name for r in results) == sorted([*arrays, *raw])
        # Each send waits for the receiver at least for its COMPLETE, within its own time;
        # a small tensor takes no turn.
        for r in results:
            assert 0 < r.waited.receiver <= r.seconds, r
            assert r.waited.turn == 0 and r.waited.transport >= 0 and r.waited.source >= 0, r
            # Spec §6.8: the receiver says where it landed; it shares nothing here.
            assert r.device == "host" and r.receipt["tensorwire.device"] == "host", r
            assert r.shared_id is None and r.shared_generation is None, r
        out = rx.wait()
    finally:
        rx.stop()
    for name, array in arrays.items():
        header, data = read_safetensors(tmp_path / f"{name}.safetensors")
        assert header[name]["dtype"] == NUMPY_NAME[name], out
        assert header[name]["shape"] == list(array.shape)
        assert data == array.tobytes()
    for name, r in raw.items():
        header, data = read_safetensors(tmp_path / f"{name}.safetensors")
        assert header[name]["dtype"] == r.dtype and header[name]["shape"] == list(r.shape)
        assert data == bytes(r.data)


def test_a_safetensors_file_sent_from_python_is_saved_bit_exact(tmp_path):
    source = tmp_path / "model.safetensors"
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 32)).astype(np.float32).tobytes()
    b = rng.standard_normal(32).astype(np.float16).tobytes()
    ids = np.arange(10, dtype=np.int64).tobytes()
    write_safetensors(source, {"layer.bias": ("F16", [32], b), "layer.weight": ("F32", [64, 32], w),
                               "ids": ("I64", [10], ids)}, metadata={"format": "pt", "step": "12"})
    saved = tmp_path / "saved"
    rx = RustReceiver("--save", str(saved), "--count", "3")
    try:
        tensorwire.send(rx.addr, source, connections=2)
        rx.wait()
    finally:
        rx.stop()
    header, data = read_safetensors(saved / "model.safetensors")
    original, original_data = read_safetensors(source)
    assert header["__metadata__"] == original["__metadata__"]
    for name, info in original.items():
        if name == "__metadata__":
            continue
        got = header[name]
        assert (got["dtype"], got["shape"]) == (info["dtype"], info["shape"])
        begin, end = info["data_offsets"]
        got_begin, got_end = got["data_offsets"]
        assert data[got_begin:got_end] == original_data[begin:end]


def test_python_receives_what_the_rust_sender_sends(tmp_path):
    source = tmp_path / "pair.safetensors"
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    c = np.array([1, -2, 3], dtype=np.int32)
    write_safetensors(source, {"a": ("F32", [3, 4], a.tobytes()), "c": ("I32", [3], c.tobytes())})
    with tensorwire.Receiver(device="host") as rx:
        sent = subprocess.run([program("sender"), "--connect", rx.address, "--quiet", str(source)],
                              capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr
        got = {}
        for _ in range(2):
            t = rx.recv(timeout=30)
            assert t.device == "cpu"
            assert t.attributes["tensorwire.file"] == "pair.safetensors"
            got[t.name] = t.numpy()
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["c"], c)


def test_a_tensor_the_rust_sender_splits_arrives_whole(tmp_path):
    # 40 MiB over 4 connections: the sender sends it as 3 parts (spec §15), which the
    # receiver puts back together and hands over once.
    source = tmp_path / "embed.safetensors"
    big = np.random.default_rng(7).integers(0, 256, size=(40, 1 << 20), dtype=np.uint8)
    write_safetensors(source, {"embed": ("U8", [40, 1 << 20], big.tobytes())})
    with tensorwire.Receiver(device="host") as rx:
        sent = subprocess.run([program("sender"), "--connect", rx.address, "--quiet",
                               "--connections", "4", str(source)],
                              capture_output=True, text=True, timeout=120)
        assert sent.returncode == 0, sent.stderr
        assert "(3 streams)" in sent.stdout, sent.stdout
        t = rx.recv(timeout=60)
        assert (t.name, t.shape) == ("embed", (40, 1 << 20))
        assert "tensorwire.split.id" not in t.attributes
        np.testing.assert_array_equal(t.numpy(), big)
        with pytest.raises(TimeoutError):
            rx.recv(timeout=0.5)


def test_python_splits_a_large_tensor_over_its_connections():
    # 48 MiB over 4 connections: parts of 16 MiB (spec §15), one tensor when it lands.
    big = np.random.default_rng(8).integers(0, 256, size=(48, 1 << 20), dtype=np.uint8)
    with tensorwire.Receiver(device="host") as rx:
        results = tensorwire.send(rx.address, {"big": big}, connections=4)
        assert [(r.name, r.nbytes) for r in results] == [("big", 48 << 20)]
        t = rx.recv(timeout=60)
        assert (t.name, t.shape) == ("big", (48, 1 << 20))
        np.testing.assert_array_equal(t.numpy(), big)
        with pytest.raises(TimeoutError):
            rx.recv(timeout=0.5)
    # Sent whole when asked: a receiver older than protocol 1.3 gets it in one piece too.
    with tensorwire.Receiver(device="host") as rx:
        tensorwire.send(rx.address, {"big": big}, connections=4, split=False)
        np.testing.assert_array_equal(rx.recv(timeout=60).numpy(), big)


def test_every_dtype_round_trips_python_to_python():
    arrays, raw = sample_arrays()
    with tensorwire.Receiver(device="host") as rx:
        tensorwire.send(rx.address, {**arrays, **raw}, connections=3)
        got = {}
        for _ in range(len(arrays) + len(raw)):
            t = rx.recv(timeout=30)
            got[t.name] = t
    for name, array in arrays.items():
        t = got[name]
        assert (t.dtype, t.shape) == (NUMPY_NAME[name], array.shape)
        np.testing.assert_array_equal(t.numpy(), array)
    bf16 = got["bf16"].numpy()
    assert bf16.dtype == np.uint16 and bf16.shape == (4, 2)
    assert bf16.tobytes() == bytes(raw["bf16"].data)
    fp8 = got["fp8_e5m2"].numpy()
    assert fp8.dtype == np.uint8 and fp8.tobytes() == bytes([1, 2, 250, 255])


def test_host_tensors_are_handed_to_numpy_without_a_copy():
    with tensorwire.Receiver(device="host") as rx:
        tensorwire.send(rx.address, {"x": np.arange(1000, dtype=np.float64)})
        t = rx.recv(timeout=30)
        address = t.data_ptr
        array = np.from_dlpack(t)
        assert array.__array_interface__["data"][0] == address
        np.testing.assert_array_equal(array, np.arange(1000, dtype=np.float64))
        with pytest.raises(RuntimeError, match="already handed over"):
            t.tobytes()
        # Host memory has no CUDA Array Interface, so frameworks look for another way.
        assert not hasattr(t, "__cuda_array_interface__")


def test_a_received_tensor_is_forwarded_through_dlpack():
    values = np.linspace(0, 1, 300, dtype=np.float32).reshape(3, 100)
    with tensorwire.Receiver(device="host") as first, tensorwire.Receiver(device="host") as second:
        tensorwire.send(first.address, {"x": values})
        received = first.recv(timeout=30)
        tensorwire.send(second.address, {"forwarded": received})
        again = second.recv(timeout=30)
    assert (again.name, again.dtype, again.shape) == ("forwarded", "F32", (3, 100))
    np.testing.assert_array_equal(again.numpy(), values)


def test_tensors_go_over_tcp_when_asked():
    arrays, _ = sample_arrays()
    with tensorwire.Receiver(device="host") as rx:
        tensorwire.send(rx.address, arrays, connections=2, transport="tcp")
        got = {t.name: t for t in (rx.recv(timeout=30) for _ in arrays)}
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name].numpy(), array)
    with pytest.raises(ValueError, match="quic, tcp or auto"):
        tensorwire.send("127.0.0.1:9", {"x": b"abc"}, transport="carrier-pigeon")


def test_a_bad_address_raises_the_typed_error():
    with pytest.raises(TensorwireError) as bad:
        tensorwire.send("not-an-address", {"x": b"abc"})
    assert "not-an-address" in str(bad.value)
    # Nobody listens there, so no development certificate either.
    with pytest.raises(TensorwireError):
        tensorwire.send("127.0.0.1:9", {"x": b"abc"})


def test_host_names_are_taken_where_addresses_are():
    with tensorwire.Receiver(listen="localhost:0", device="host") as rx:
        port = rx.address.rsplit(":", 1)[1]
        tensorwire.send(f"localhost:{port}", {"named": b"abcd"})
        t = rx.recv(timeout=30)
        assert (t.name, bytes(t.numpy())) == ("named", b"abcd")


def test_a_receiver_with_another_certificate_is_refused():
    a, b = RustReceiver(), RustReceiver()
    try:
        with pytest.raises(TensorwireError) as refused:
            tensorwire.send(a.addr, {"x": b"abc"}, ca=b.dev_cert())
        assert refused.value.code is None or refused.value.code_name, refused.value
        assert "certificate" in str(refused.value).lower() or "tls" in str(refused.value).lower()
    finally:
        a.stop()
        b.stop()


def test_a_rejected_tensor_raises_with_its_code_and_name():
    rx = RustReceiver("--max-tensor-mib", "1")
    try:
        with pytest.raises(TensorwireError) as rejected:
            tensorwire.send(rx.addr, {"too.big": np.zeros(1 << 19, dtype=np.float32)})
    finally:
        rx.stop()
    err = rejected.value
    assert err.code_name == "TENSOR_TOO_LARGE" and err.code == 0x0211
    assert err.tensor == "too.big" and err.blame == "PeerBrokeRule"


def scrape(address):
    """The metrics a receiver serves at http://ADDRESS/metrics, by sample name and labels."""
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
        text = reply.read().decode()
    return samples(text)


def samples(text):
    """An OpenMetrics exposition's samples, by name and labels."""
    assert text.endswith("# EOF\n")
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_a_receiver_serves_metrics_that_count_what_landed_and_what_was_refused():
    with tensorwire.Receiver(device="host", host_memory_mib=1, admission_timeout_s=0.5, metrics="127.0.0.1:0") as rx:
        assert rx.metrics_address is not None
        before = scrape(rx.metrics_address)
        assert before['tensorwire_received_tensors_total{outcome="completed"}'] == 0
        assert before['tensorwire_memory_limit_bytes{memory="host"}'] == 1 << 20
        tensorwire.send(rx.address, {"fits": np.ones(1000, np.float32)})
        rx.recv(timeout=30)
        with pytest.raises(TensorwireError):
            tensorwire.send(rx.address, {"too.big": np.ones(1 << 19, np.float32)})
        # A scrape reads the counters of tensors whose streams have ended; those end just
        # after the sender hears of them.
        for _ in range(100):
            after = scrape(rx.metrics_address)
            if after['tensorwire_received_tensors_total{outcome="failed"}'] == 1:
                break
            time.sleep(0.1)
        assert after['tensorwire_received_tensors_total{outcome="completed"}'] == 1
        assert after['tensorwire_received_tensors_total{outcome="failed"}'] == 1
        assert after['tensorwire_received_tensor_failures_total{code="RESOURCE_EXHAUSTED"}'] == 1
        assert after["tensorwire_received_payload_bytes_total"] >= 4000
        # The same text, for a server of the application's own.
        assert 'tensorwire_received_tensors_total{outcome="completed"} 1' in rx.metrics_text()
    with tensorwire.Receiver(device="host") as quiet:
        assert quiet.metrics_address is None and "# EOF" in quiet.metrics_text()


def test_a_failed_send_carries_what_was_sent_beside_it():
    with tensorwire.Receiver(device="host", host_memory_mib=1, admission_timeout_s=0.5) as rx:
        with pytest.raises(TensorwireError) as failed:
            tensorwire.send(rx.address, {"ok": np.ones(10, np.float32), "too.big": np.ones(1 << 19, np.float32)})
        err = failed.value
        assert err.tensor == "too.big" and err.code_name == "RESOURCE_EXHAUSTED", err
        assert [r.name for r in err.sent] == ["ok"] and err.sent[0].nbytes == 40
        assert err.failures == [err]
        assert rx.recv(timeout=30).name == "ok"


def test_progress_is_reported_while_sending_and_its_exception_stops_the_send():
    seen = []
    tensors = {"a": np.ones(1 << 20, np.float32), "b": np.ones(1000, np.uint8)}
    with tensorwire.Receiver(device="host") as rx:
        tensorwire.send(rx.address, tensors, progress=seen.append)
        assert seen and all(isinstance(p, tensorwire.SendProgress) for p in seen)
        last = seen[-1]
        assert last.sent_bytes == last.total_bytes == (4 << 20) + 1000
        assert last.tensors == {"a": (4 << 20, 4 << 20), "b": (1000, 1000)} and last.tensors_done == 2
        assert [p.sent_bytes for p in seen] == sorted(p.sent_bytes for p in seen)

        class Stop(Exception):
            pass

        def stop(progress):
            raise Stop()

        with pytest.raises(Stop):
            tensorwire.send(rx.address, tensors, progress=stop)


def test_ctrl_c_stops_a_send_that_waits():
    import _thread

    # The first tensor fills the receiver's memory and is not taken: the second waits a
    # minute for room, unless the send is interrupted.
    with tensorwire.Receiver(device="host", host_memory_mib=1, admission_timeout_s=60) as rx:
        tensorwire.send(rx.address, {"holds": np.ones(200_000, np.float32)})
        interrupt = threading.Timer(0.5, _thread.interrupt_main)
        interrupt.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            tensorwire.send(rx.address, {"waits": np.ones(200_000, np.float32)})
        # Interrupted, not waited out (the admission wait is a minute).
        assert time.monotonic() - started < 30
        interrupt.join()


def test_receiving_nothing_raises_kinds_of_the_one_error():
    rx = tensorwire.Receiver(device="host")
    with pytest.raises(tensorwire.ReceiveTimeout) as waited:
        rx.recv(timeout=0.1)
    assert isinstance(waited.value, TimeoutError) and isinstance(waited.value, TensorwireError)
    rx.close()
    with pytest.raises(tensorwire.ReceiverClosed) as closed:
        rx.recv(timeout=1)
    assert isinstance(closed.value, EOFError) and isinstance(closed.value, TensorwireError)
    assert list(rx) == []


def test_a_npy_path_is_sent_as_one_tensor_named_after_the_file(tmp_path):
    array = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    np.save(tmp_path / "weights.npy", array)
    (tmp_path / "other.npy").write_bytes(b"not an array")
    with tensorwire.Receiver(device="host") as rx:
        tensorwire.send(rx.address, tmp_path / "weights.npy")
        t = rx.recv(timeout=30)
        assert (t.name, t.dtype, t.shape) == ("weights", "I16", (2, 3, 4))
        assert np.array_equal(t.numpy(), array)
        with pytest.raises(TensorwireError, match="not a NumPy array file"):
            tensorwire.send(rx.address, str(tmp_path / "other.npy"))
    # Any other path is a .safetensors file: an array saved under another name says so.
    shutil.copy(tmp_path / "weights.npy", tmp_path / "weights.bin")
    with pytest.raises(TensorwireError, match="not a .safetensors file"):
        tensorwire.send("127.0.0.1:9", tmp_path / "weights.bin")


def write_float_wav(path, samples, rate, channels):
    """A 32-bit float WAV (format 3), which the standard library's wave module cannot write."""
    data = np.asarray(samples, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, channels, rate, rate * 4 * channels, 4 * channels, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def test_a_wav_path_lands_as_the_rust_sender_sends_it_with_user_attributes(tmp_path):
    import wave

    pcm = np.array([[0, 1000], [-32768, 32767], [12, -12]], dtype="<i2")
    with wave.open(str(tmp_path / "speech.wav"), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    write_float_wav(tmp_path / "tone.wav", [0.5, -0.25, 1.0], 44100, 1)
    with tensorwire.Receiver(device="host") as rx:
        tensorwire.send(rx.address, tmp_path / "speech.wav", attributes={"speaker": "ana"})
        ours = rx.recv(timeout=30)
        sent = subprocess.run([program("sender"), "--connect", rx.address, "--quiet", str(tmp_path / "speech.wav")],
                              capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr
        theirs = rx.recv(timeout=30)
        tensorwire.send(rx.address, tmp_path / "tone.wav")
        tone = rx.recv(timeout=30)
        with pytest.raises(ValueError, match="protocol's"):
            tensorwire.send(rx.address, {"x": b"abc"}, attributes={"tensorwire.split.id": "0"})
        with pytest.raises(TypeError, match="strings"):
            tensorwire.send(rx.address, {"x": b"abc"}, attributes={"rate": 16000})  # type: ignore[dict-item]
    assert (ours.name, ours.dtype, ours.shape) == ("speech", "F32", (3, 2))
    assert ours.tobytes() == theirs.tobytes(), "the same samples as the Rust sender"
    np.testing.assert_array_equal(ours.numpy(), pcm.astype(np.float32) / 32768)
    assert ours.attributes["sample_rate"] == "16000" and ours.attributes["channels"] == "2"
    assert ours.attributes["speaker"] == "ana"
    assert {k: theirs.attributes[k] for k in ("sample_rate", "channels")} == {"sample_rate": "16000", "channels": "2"}
    assert (tone.shape, tone.attributes["sample_rate"]) == ((3,), "44100")
    np.testing.assert_array_equal(tone.numpy(), np.array([0.5, -0.25, 1.0], dtype=np.float32))


def connections_open(rx):
    """The receiver's open connections, from its metrics."""
    now = samples(rx.metrics_text())
    return int(sum(value for name, value in now.items() if name.startswith("tensorwire_connections{")))


def test_a_sender_keeps_its_connections_across_sends():
    with tensorwire.Receiver(device="host") as rx:
        with tensorwire.Sender(rx.address, connections=2) as sender:
            assert sender.connections == 2 and sender.address == rx.address
            for round in range(3):
                sent = sender.send({f"t{round}": np.full(1024, round, np.float32)})
                assert [r.name for r in sent] == [f"t{round}"]
                t = rx.recv(timeout=30)
                assert t.name == f"t{round}" and np.array_equal(t.numpy(), np.full(1024, round, np.float32))
            # Three sends, the same two connections.
            assert connections_open(rx) == 2
        with pytest.raises(TensorwireError, match="closed"):
            sender.send({"late": b"x"})


def test_a_sender_from_asyncio():
    async def main():
        with tensorwire.Receiver(device="host") as rx:
            async with tensorwire.Sender(rx.address, connections=1) as sender:
                sent = await asyncio.gather(*(sender.send_async({f"n{i}": b"abc"}) for i in range(5)))
            names = sorted(rx.recv(timeout=30).name for _ in range(5))
            return [r[0].name for r in sent], names

    sent, names = asyncio.run(main())
    assert sent == [f"n{i}" for i in range(5)] and names == sent


def test_async_send_and_receive():
    async def main():
        with tensorwire.Receiver(device="host") as rx:
            sent = await tensorwire.send_async(rx.address, {"a": np.ones(5, np.float32), "b": b"xyz"})
            assert len(sent) == 2
            names = []
            async for t in rx:
                names.append(t.name)
                if len(names) == 2:
                    break
            return sorted(names)

    assert asyncio.run(main()) == ["a", "b"]


def test_gpu_status_and_devices_describe_this_host():
    status = tensorwire.GpuStatus.detect()
    assert isinstance(status.available, bool) and status.description
    listed = tensorwire.devices()
    assert len(listed) == (status.device_count if status.available else 0)
    for d in listed:
        assert d["uuid"].startswith("GPU-") and "." in d["compute_capability"]
    # The pinned region opens with the first GPU receiver; without a GPU it never does.
    pinned = tensorwire.pinned_datagram_stats()
    assert set(pinned) == {"capacity", "lent", "served", "overflowed", "reached"}
    assert pinned["capacity"] in ((256 << 20) if status.available else 0, 0)
    assert pinned["lent"] <= pinned["capacity"] // 65536
    assert pinned["reached"] <= pinned["capacity"]


@contextlib.contextmanager
def short_socket_path():
    """A socket path well under the 108-byte limit of Unix socket addresses, removed after."""
    top = pathlib.Path(tempfile.mkdtemp(prefix="tw"))
    try:
        yield top / "share" / "tw.sock"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_socket_path_over_the_limit_is_refused_with_the_reason(tmp_path):
    long_dir = tmp_path / ("d" * 120)
    with pytest.raises(TensorwireError, match="at most 107 bytes"):
        tensorwire.ShareService(long_dir / "tw.sock")


def test_host_arrays_published_from_python_are_read_by_other_processes():
    import sys

    with short_socket_path() as sock:
        service = tensorwire.ShareService(sock)
        array = np.arange(24, dtype=np.int32).reshape(4, 6)
        assert service.publish("ids", array) >= 1
        assert service.names() == ["ids"]
        listed = subprocess.run([program("tensorwire-share"), "--socket", str(sock), "list"],
                                capture_output=True, text=True, timeout=30)
        assert listed.returncode == 0 and "ids" in listed.stdout, listed.stderr
        code = (
            "import sys, numpy as np\n"
            "from tensorwire_ipc import Client\n"
            "with Client(sys.argv[1]) as c, c.open('ids') as t:\n"
            "    print(np.frombuffer(t.read(), dtype=np.int32).sum())\n"
        )
        read = subprocess.run([sys.executable, "-c", code, str(sock)], capture_output=True, text=True, timeout=30)
        assert read.returncode == 0, read.stderr
        assert int(read.stdout.strip()) == int(array.sum())
        # One hierarchy: the consumer's refusals are TensorwireErrors too, named by code.
        from tensorwire_ipc import Client

        with Client(sock) as client, pytest.raises(tensorwire.ShareError) as refused:
            client.open("absent")
        assert isinstance(refused.value, TensorwireError), refused.value
        assert refused.value.code_name == "not_found" and refused.value.code is None, refused.value
        service.delete("ids")
        assert service.names() == []
        with pytest.raises(TensorwireError):
            service.delete("ids")
        with pytest.raises(ValueError, match="empty"):
            tensorwire.empty((2,), "F32", device="cpu")


def test_the_ipc_consumer_ships_in_the_same_package():
    import tensorwire_ipc

    assert hasattr(tensorwire_ipc, "Client")


# --- On a GPU -----------------------------------------------------------------------------


def cuda_or_skip():
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        return torch
    if os.environ.get("TENSORWIRE_REQUIRE_GPU") == "1":
        pytest.fail("TENSORWIRE_REQUIRE_GPU=1 but PyTorch has no CUDA device")
    pytest.skip("no PyTorch CUDA device")


def test_a_torch_cuda_tensor_lands_on_the_rust_receivers_gpu(tmp_path):
    torch = cuda_or_skip()
    w = torch.randn(1024, 1024, device="cuda:0")
    h = torch.randn(3000, device="cuda:0").to(torch.bfloat16)
    rx = RustReceiver("--device", "cuda:0", "--require-gpu", "--save", str(tmp_path), "--count", "2")
    try:
        tensorwire.send(rx.addr, {"w": w, "h": h})
        out = rx.wait()
    finally:
        rx.stop()
    assert "-> cuda:0" in out or "cuda:0" in out, out
    header, data = read_safetensors(tmp_path / "w.safetensors")
    assert header["w"]["dtype"] == "F32" and data == w.cpu().numpy().tobytes()
    header, data = read_safetensors(tmp_path / "h.safetensors")
    assert header["h"]["dtype"] == "BF16" and data == h.cpu().view(torch.int16).numpy().tobytes()


def test_a_torch_cuda_tensor_split_over_connections_lands_whole_on_the_gpu(tmp_path):
    torch = cuda_or_skip()
    w = torch.randn(64, 1 << 18, device="cuda:0")  # 64 MiB: 4 parts of 16 MiB
    rx = RustReceiver("--device", "cuda:0", "--require-gpu", "--save", str(tmp_path), "--count", "1")
    try:
        tensorwire.send(rx.addr, {"w": w}, connections=4)
        out = rx.wait()
    finally:
        rx.stop()
    assert out.count("rows of w") == 3, out
    assert "received w F32 [64, 262144]" in out and "cuda:0" in out, out
    header, data = read_safetensors(tmp_path / "w.safetensors")
    assert header["w"]["shape"] == [64, 1 << 18] and data == w.cpu().numpy().tobytes()


def test_received_gpu_tensors_go_to_torch_with_no_copy_and_back_to_the_pool():
    torch = cuda_or_skip()
    with tensorwire.Receiver(device="cuda:0", require_gpu=True) as rx:
        source = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
        tensorwire.send(rx.address, {"x": source})
        t = rx.recv(timeout=60)
        assert t.device == "cuda:0"
        pointer = t.data_ptr
        x = torch.from_dlpack(t)
        assert x.device.type == "cuda" and x.data_ptr() == pointer
        assert torch.equal(x, source)
        before = rx.pool_stats()["device"]
        assert before["in_use_buffers"] >= 1
        del x, t
        torch.cuda.synchronize()
        after = rx.pool_stats()["device"]
        assert after["returns"] == before["returns"] + 1, (before, after)
        assert after["in_use_buffers"] == before["in_use_buffers"] - 1
        assert after["outside_pool"] == 0, after
        # 96 MiB: past the default pool's largest buffer (64 MiB), so memory of its own.
        # Its datagrams (65,507 bytes on loopback) land in the pinned region, and the copy
        # engine reads the payloads from there.
        pinned = tensorwire.pinned_datagram_stats()
        assert pinned["capacity"] == 256 << 20, pinned
        big = torch.arange(24 << 20, dtype=torch.float32, device="cuda:0")
        tensorwire.send(rx.address, {"big": big})
        landed = rx.recv(timeout=60)
        assert torch.equal(torch.from_dlpack(landed), big)
        assert rx.pool_stats()["device"]["outside_pool"] == 1
        after = tensorwire.pinned_datagram_stats()
        assert after["served"] - pinned["served"] >= 1000, (pinned, after)
        # How far into the region slots were lent is reported, and within it.
        assert 0 < after["reached"] <= after["capacity"], after


def test_received_gpu_tensors_have_the_cuda_array_interface():
    torch = cuda_or_skip()
    with tensorwire.Receiver(device="cuda:0", require_gpu=True) as rx:
        w = torch.randn(64, 32, device="cuda:0")
        h = torch.randn(100, device="cuda:0").to(torch.bfloat16)
        tensorwire.send(rx.address, {"w": w, "h": h})
        got = {t.name: t for t in (rx.recv(timeout=60) for _ in range(2))}
        cai = got["w"].__cuda_array_interface__
        assert cai["shape"] == (64, 32) and cai["typestr"] == "<f4" and cai["version"] == 3, cai
        assert cai["data"] == (got["w"].data_ptr, False), cai
        # PyTorch reads the interface with no copy: the same device memory.
        x = torch.as_tensor(got["w"], device="cuda:0")
        assert x.data_ptr() == got["w"].data_ptr and torch.equal(x, w)
        # BF16 has no interface type: its bytes.
        raw = got["h"].__cuda_array_interface__
        assert raw["shape"] == (200,) and raw["typestr"] == "|u1", raw
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            c = cupy.asarray(got["w"])
            assert c.data.ptr == got["w"].data_ptr
            assert cupy.asnumpy(c).tobytes() == w.cpu().numpy().tobytes()
        del x
        # Handed over through DLPack, the tensor no longer offers its memory another way.
        y = torch.from_dlpack(got["w"])
        assert not hasattr(got["w"], "__cuda_array_interface__")
        del y


def test_a_tensor_published_from_python_is_mapped_by_rust_and_python_and_written_in_place():
    import sys

    torch = cuda_or_skip()
    with short_socket_path() as sock:
        service = tensorwire.ShareService(sock)
        buf = tensorwire.empty((256, 256), "F32", device="cuda:0")
        w = torch.from_dlpack(buf)
        assert w.data_ptr() == buf.data_ptr and torch.count_nonzero(w).item() == 0
        w.copy_(torch.arange(65536, dtype=torch.float32, device="cuda:0").reshape(256, 256))
        service.publish("weights", buf)
        rust = subprocess.run([program("tensorwire-share"), "--socket", str(sock), "wait", "weights"],
                              capture_output=True, text=True, timeout=60)
        assert rust.returncode == 0 and "weights" in rust.stdout, rust.stderr
        code = (
            "import sys, torch\n"
            "from tensorwire_ipc import Client\n"
            "with Client(sys.argv[1]) as c, c.open('weights') as t:\n"
            "    x = torch.from_dlpack(t)\n"
            "    assert x[0, 1].item() == 1.0, x[0, 1]\n"
            "    x.mul_(2)\n"
            "    torch.cuda.synchronize()\n"
            "    del x\n"
        )
        python = subprocess.run([sys.executable, "-c", code, str(sock)], capture_output=True, text=True, timeout=120)
        assert python.returncode == 0, python.stderr
        torch.cuda.synchronize()
        assert w[0, 1].item() == 2.0 and w[255, 255].item() == 2.0 * 65535


def test_a_received_gpu_tensor_is_forwarded_from_device_memory():
    torch = cuda_or_skip()
    source = torch.randn(512, 256, device="cuda:0")
    with tensorwire.Receiver(device="cuda:0", require_gpu=True) as first, \
            tensorwire.Receiver(device="cuda:0", require_gpu=True) as second:
        tensorwire.send(first.address, {"x": source})
        received = first.recv(timeout=60)
        assert received.device == "cuda:0"
        tensorwire.send(second.address, {"forwarded": received})
        again = second.recv(timeout=60)
        assert again.device == "cuda:0"
        assert torch.equal(again.torch(), source)


# --- Remote execution from Python (spec §14) ------------------------------------------------


def kernels_ptx() -> pathlib.Path:
    source = pathlib.Path(os.environ.get("TENSORWIRE_SOURCE_DIR", ROOT))
    return source / "examples" / "tests" / "kernels" / "kernels.ptx"


def exec_server(env=None):
    """`receiver --allow-exec` on loopback with its worker program."""
    return RustReceiver("--allow-exec", "--exec-worker", program("tensorwire-exec-worker"), env=env)


def add_args(n):
    from tensorwire.exec import Input, Output, Scalar

    x = np.arange(n, dtype=np.float32) * 0.25
    return x, [Input("in", x), Output("out", "F32", (n,)), Scalar("delta", "F32", 1.5), Scalar("n", "I32", n)]


def test_remote_execution_without_a_gpu_answers_info_and_refuses_runs_with_the_code():
    from tensorwire.exec import Client

    server = exec_server(env={"CUDA_VISIBLE_DEVICES": ""})
    try:
        with Client(server.addr) as gpu:
            assert "disabled: no GPU" in gpu.info()["exec"], gpu.info()
            assert gpu.health()["workers"] == "0", gpu.health()
            _, args = add_args(1024)
            with pytest.raises(TensorwireError) as refused:
                gpu.run(kernels_ptx(), "add", grid=(4,), block=(256,), args=args)
            assert refused.value.code_name == "UNSUPPORTED_DEVICE", refused.value
            assert "no GPU" in str(refused.value)
            # Wrong arguments fail here, before anything is sent.
            with pytest.raises(ValueError, match="grid"):
                gpu.run(kernels_ptx(), "add", grid=(0,), block=(256,), args=args)
            with pytest.raises(TensorwireError, match="no-such.ptx"):
                gpu.run("no-such.ptx", "add", grid=(4,), block=(256,), args=args)
        with pytest.raises(TensorwireError, match="closed"):
            gpu.health()
    finally:
        server.stop()


def test_remote_execution_admits_by_access_token(tmp_path):
    from tensorwire.exec import Client

    secret = "4f1c9a0d7e2b6c58a1f3d9e0b7c2a465"
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    server = RustReceiver("--allow-exec", "--exec-worker", program("tensorwire-exec-worker"),
                          "--exec-token-file", str(token_file), env={"CUDA_VISIBLE_DEVICES": ""})
    try:
        with Client(server.addr) as stranger, pytest.raises(TensorwireError) as refused:
            stranger.health()
        assert refused.value.code_name == "EXEC_NOT_ALLOWED", refused.value
        with Client(server.addr, token=secret) as holder:
            assert holder.health()["workers"] == "0"
        with Client(server.addr, token_file=str(token_file)) as holder:
            assert "exec" in holder.info()
        with pytest.raises(TensorwireError, match="printable"):
            Client(server.addr, token="too short")
    finally:
        server.stop()


def test_a_kernel_runs_on_the_receivers_gpu_from_python_and_its_module_is_sent_once():
    from tensorwire.exec import Client

    status = tensorwire.GpuStatus.detect()
    if not status.available:
        if os.environ.get("TENSORWIRE_REQUIRE_GPU") == "1":
            pytest.fail(f"TENSORWIRE_REQUIRE_GPU=1 but no GPU: {status.description}")
        pytest.skip(f"no GPU: {status.description}")
    server = exec_server()
    try:
        with Client(server.addr) as gpu:
            assert gpu.info()["device.name"], gpu.info()
            x, args = add_args(4096)
            first = gpu.run(kernels_ptx(), "add", grid=(16,), block=(256,), args=args)
            np.testing.assert_array_equal(first.outputs["out"], x + np.float32(1.5))
            assert first.module_sent and first.timings.kernel > 0, first
            assert 0 < first.timings.kernel <= first.timings.total <= first.round_trip, first.timings
            again = gpu.run(kernels_ptx(), "add", grid=(16,), block=(256,), args=args)
            assert not again.module_sent, "the server keeps the module by its hash"
            np.testing.assert_array_equal(again.outputs["out"], first.outputs["out"])
    finally:
        server.stop()


def test_a_tensor_pytorch_allocated_is_published_with_no_copy_and_written_in_place_by_a_consumer():
    import sys

    torch = cuda_or_skip()
    with short_socket_path() as sock:
        service = tensorwire.ShareService(sock)
        # A slice: the tensor starts inside an allocation of PyTorch's caching allocator.
        whole = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
        w = whole[4096:4096 + 65536].view(256, 256)
        assert service.publish("framework", w) == 1
        code = (
            "import sys, torch\n"
            "from tensorwire_ipc import Client\n"
            "with Client(sys.argv[1]) as c, c.open('framework') as t:\n"
            "    x = torch.from_dlpack(t)\n"
            "    assert x.shape == (256, 256) and x[0, 0].item() == 4096.0, (x.shape, x[0, 0])\n"
            "    x.mul_(2)\n"
            "    torch.cuda.synchronize()\n"
            "    del x\n"
        )
        python = subprocess.run([sys.executable, "-c", code, str(sock)], capture_output=True, text=True, timeout=120)
        assert python.returncode == 0, python.stderr
        torch.cuda.synchronize()
        # The consumer wrote PyTorch's own memory: the producer sees it with no copy.
        assert w[0, 0].item() == 2 * 4096.0 and w[255, 255].item() == 2 * (4096.0 + 65535)
        assert whole[4095].item() == 4095.0, "bytes outside the tensor are untouched"
        # Replacing the name lets the first publication's memory go with its last lease.
        assert service.publish("framework", torch.zeros(4, device="cuda:0")) == 2
