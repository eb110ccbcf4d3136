"""Unit tests: request validation (every limit of the contract), config loading, status mapping."""

from __future__ import annotations

import os
import re

import grpc
import pytest

from qdelay import errors
from qdelay.segments import records
from qdelay.server import config as config_mod
from qdelay.server.config import ConfigError, Limits, ServerConfig
from qdelay.server.status import status_of
from qdelay.server.validation import (
    IdGenerator,
    encode_messages,
    validate_cancel_batch,
    validate_receipt,
    validate_subscribe,
)
from qdelay.v1 import qdelay_pb2 as pb

NOW = 1_700_000_000_000
LIMITS = Limits()


def run(messages, limits=LIMITS, single=False):
    """Validate and encode; decode the bodies again: [(subject, payload, headers, id, due)], bytes."""
    batch = encode_messages(messages, limits, NOW, IdGenerator(), single=single)
    decoded = [records.decode_message(body) for body in batch.bodies]
    assert [m.message_id for m in decoded] == batch.ids
    assert [m.deliver_at_ms for m in decoded] == batch.dues
    return [(m.subject, m.payload, m.headers, m.message_id, m.deliver_at_ms) for m in decoded], batch.payload_bytes


def msg(**kw):
    kw.setdefault("subject", "order.close")
    if "deliver_at_ms" not in kw and "delay_ms" not in kw and not kw.pop("no_time", False):
        kw["delay_ms"] = 1000
    return pb.Message(**kw)


def refused(messages, *needles, single=False):
    with pytest.raises(errors.InvalidArgument) as info:
        run(messages, single=single)
    text = str(info.value)
    for needle in needles:
        assert needle in text, text
    return text


def test_valid_batch_resolves_due_and_ids():
    out, total = run([msg(payload=b"abc"), msg(deliver_at_ms=NOW + 5, message_id="m-1", headers={"k": "v"})])
    assert out[0][4] == NOW + 1000 and out[0][3]  # generated id
    assert out[1] == ("order.close", b"abc"[:0], {"k": "v"}, "m-1", NOW + 5)
    assert total == 3


def test_generated_ids_unique():
    gen = IdGenerator()
    ids = {gen() for _ in range(10_000)}
    assert len(ids) == 10_000
    assert IdGenerator()() != IdGenerator()()


def test_past_due_accepted():
    out, _ = run([msg(deliver_at_ms=1)])
    assert out[0][4] == 1


@pytest.mark.parametrize(
    "subject,needle",
    [
        ("", "required"),
        ("a" * 256, "256 characters, limit 255"),
        ("a b", "' '"),
        ("é", "'é'"),
        ("a/b", "'/'"),
    ],
)
def test_subject(subject, needle):
    refused([msg(), msg(subject=subject)], "messages[1].subject", needle)


def test_subject_max_ok():
    run([msg(subject="A-z_0.9" + "x" * 248)])


def test_payload_limit():
    run([msg(payload=b"x" * LIMITS.max_payload_bytes)])
    refused([msg(payload=b"x" * (LIMITS.max_payload_bytes + 1))], "messages[0].payload", "4194305 bytes, limit 4194304")


def test_headers():
    run([msg(headers={f"k{i}": "v" for i in range(64)})])
    refused([msg(headers={f"k{i}": "v" for i in range(65)})], "headers", "65 entries, limit 64")
    refused([msg(headers={"": "v"})], "headers", "empty key")
    refused([msg(headers={"k" * 129: "v"})], "129 bytes, limit 128")
    refused([msg(headers={"a": "x" * 16 * 1024})], "bytes in all, limit 16384")
    run([msg(headers={"a": "x" * (16 * 1024 - 1)})])


def test_message_id():
    run([msg(message_id="x" * 128)])
    refused([msg(message_id="x" * 129)], "message_id", "129 bytes, limit 128")
    refused([msg(message_id="caf\u00e9")], "message_id", "printable ASCII")
    refused([msg(message_id="a\nb")], "printable ASCII")
    refused([msg(message_id="same"), msg(message_id="same")], "messages[1].message_id", "repeats messages[0]")


def test_due_time():
    refused([msg(no_time=True)], "exactly one of deliver_at_ms or delay_ms")
    run([msg(delay_ms=LIMITS.max_delay_ms)])
    refused(
        [msg(delay_ms=LIMITS.max_delay_ms + 1)],
        "delay_ms",
        "2 years 1 ms)",
        "limit of 2 years (max_delay_ms=63072000000)",
    )
    refused([msg(delay_ms=2**63 - 1)], "delay_ms")  # no overflow
    refused([msg(delay_ms=-5)], "negative")
    run([msg(deliver_at_ms=NOW + LIMITS.max_delay_ms)])
    refused(
        [msg(deliver_at_ms=NOW + LIMITS.max_delay_ms + 1)],
        "deliver_at_ms",
        "limit of 2 years (max_delay_ms=63072000000)",
    )
    refused([msg(deliver_at_ms=2**63 - 1)], "deliver_at_ms")
    refused([msg(deliver_at_ms=-1)], "before 1970")


def test_batch_limits():
    refused([], "empty batch")
    refused([msg()] * 10_001, "10001 messages in one batch, limit 10000 messages (limits.max_batch)")
    run([msg()] * 10_000)


def test_single_names_message():
    refused([msg(subject="")], "message.subject", single=True)


def test_custom_limits():
    limits = Limits(max_payload_bytes=10, max_batch=2)
    with pytest.raises(errors.InvalidArgument, match="limit 10"):
        run([msg(payload=b"x" * 11)], limits=limits)
    with pytest.raises(errors.InvalidArgument, match="limit 2"):
        run([msg()] * 3, limits=limits)


def test_receipt_and_subscribe():
    with pytest.raises(errors.InvalidArgument, match="receipt or message_id: required"):
        validate_receipt(pb.CancelRequest(), LIMITS)
    assert validate_receipt(pb.CancelRequest(message_id="order-7"), LIMITS) == ("order-7", None, None)
    with pytest.raises(errors.InvalidArgument, match="message_id: 'b' disagrees with receipt.message_id 'a'"):
        validate_receipt(
            pb.GetRequest(receipt=pb.Receipt(message_id="a", deliver_at_ms=5, sequence=7), message_id="b"), LIMITS
        )
    with pytest.raises(errors.InvalidArgument, match="message_id: 200 bytes"):
        validate_receipt(pb.CancelRequest(message_id="x" * 200), LIMITS)
    with pytest.raises(errors.InvalidArgument, match="receipt.message_id: required"):
        validate_receipt(pb.CancelRequest(receipt=pb.Receipt(deliver_at_ms=5)), LIMITS)
    assert validate_receipt(pb.GetRequest(receipt=pb.Receipt(message_id="a", deliver_at_ms=5, sequence=7)), LIMITS) == (
        "a",
        5,
        7,
    )
    assert validate_subscribe(pb.SubscribeRequest(subject="s"), LIMITS) == ("s", "default")
    with pytest.raises(errors.InvalidArgument, match="subject"):
        validate_subscribe(pb.SubscribeRequest(), LIMITS)
    with pytest.raises(errors.InvalidArgument, match="group"):
        validate_subscribe(pb.SubscribeRequest(subject="s", group="a b"), LIMITS)


# ---------------------------------------------------------------- status mapping
@pytest.mark.parametrize(
    "error,code",
    [
        (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.DiskFull("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.NotMaster("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.Fenced("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ShuttingDown("x"), grpc.StatusCode.UNAVAILABLE),
        (errors.WalFailed("x"), grpc.StatusCode.UNAVAILABLE),
        (errors.Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.CorruptRecord("seg", 10, "bad"), grpc.StatusCode.DATA_LOSS),
        (RuntimeError("secret internals"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_mapping(error, code):
    got, message = status_of(error)
    assert got == code
    assert "secret" not in message


# ---------------------------------------------------------------- config
def test_config_file_and_flags(tmp_path):
    path = tmp_path / "q.toml"
    path.write_text(
        'listen = "127.0.0.1:9999"\nmin_free_bytes = 5\n[limits]\nmax_batch = 7\n[engine]\nack_timeout_ms = 500\n'
    )
    cfg = config_mod.load_file(str(path))
    assert cfg.listen == "127.0.0.1:9999" and cfg.min_free_bytes == 5
    assert cfg.limits.max_batch == 7 and cfg.engine_options == {"ack_timeout_ms": 500}
    cfg.validate()


def test_config_errors(tmp_path):
    path = tmp_path / "q.toml"
    path.write_text('lisen = "x"\n')
    with pytest.raises(ConfigError, match="unknown key 'lisen'"):
        config_mod.load_file(str(path))
    path.write_text("[limits]\nmax_batc = 1\n")
    with pytest.raises(ConfigError, match="limits.max_batc"):
        config_mod.load_file(str(path))
    path.write_text("listen = \n")
    with pytest.raises(ConfigError, match="q.toml"):
        config_mod.load_file(str(path))
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ServerConfig(listen="7600").validate()
    with pytest.raises(ConfigError, match="--master"):
        ServerConfig(role="slave").validate()
    with pytest.raises(ConfigError, match="both"):
        ServerConfig(tls_cert="a").validate()
    with pytest.raises(ConfigError, match="max_batch"):
        ServerConfig(limits=Limits(max_batch=0)).validate()


def test_flat_engine_keys_land_in_the_nested_configs(tmp_path):
    """The [engine] keys stay flat for users (docs/operations.md); inside, each lands in the
    config of the piece that uses it, through the one mapping (config.ENGINE_KEYS)."""
    path = tmp_path / "q.toml"
    path.write_text(
        '[engine]\nack_timeout_ms = 500\nscale_minutes = 5\ncleaner_enabled = false\nflush = "interval:5"\n'
    )
    ecfg = config_mod.load_file(str(path)).engine
    assert ecfg.scheduler.ack_timeout_ms == 500 and ecfg.scheduler.scale_minutes == ecfg.scale_minutes == 5
    assert ecfg.cleaner.enabled is False and ecfg.flush == "interval:5"
    assert ecfg.data_dir == "./data" and ecfg.scheduler.max_attempts == 16  # the rest: defaults
    path.write_text("[engine]\nack_timeout = 1\n")
    with pytest.raises(ConfigError, match="unknown \\[engine\\] option.*ack_timeout .*ack_timeout_ms"):
        config_mod.build_engine_config(config_mod.load_file(str(path)))


def test_a_group_bound_of_its_own_from_a_file_or_set(tmp_path):
    """``[engine.group_max_ready_of]``: "SUBJECT/GROUP" = entries; anything else is refused
    at start-up with the key named."""
    import argparse

    from qdelay.server import main

    path = tmp_path / "q.toml"
    path.write_text('[engine.group_max_ready_of]\n"orders.close/billing" = 500000\n')
    ecfg = config_mod.load_file(str(path)).engine
    assert ecfg.scheduler.group_max_ready_of == {"orders.close/billing": 500000}
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["--set", 'engine.group_max_ready_of={"mail/default" = 7}'])
    assert main.config_from_args(args).engine.scheduler.group_max_ready_of == {"mail/default": 7}
    for bad, match in (
        ('{"orders.close" = 5}', 'not "SUBJECT/GROUP"'),
        ('{"a/b" = 0}', "not a positive number"),
        ('{"a/b" = "many"}', "not a positive number"),
        ("5", "a table of"),
    ):
        args = parser.parse_args(["--set", f"engine.group_max_ready_of={bad}"])
        with pytest.raises(ConfigError, match=match):
            main.config_from_args(args).engine  # noqa: B018 - building it is the check


def test_the_engine_keys_are_the_documented_ones():
    """Every key of the [engine] table in docs/operations.md is mapped, and nothing else."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "operations.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("### `[engine]`", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            documented.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    derived = {"data_dir", "role", "max_delay_ms"}  # top-level keys, filled in (build_engine_config)
    assert set(config_mod.ENGINE_KEYS) == documented | derived


def test_engine_keys_the_server_fills_in_are_refused_in_engine(tmp_path):
    """``--set engine.data_dir=...`` (or ``[engine] data_dir``) was accepted and won over
    ``--data-dir``: a real server started so wrote its logs in that other folder. It, role and
    max_delay_ms are filled in from the server's own keys; in [engine] they are refused at
    start-up, naming the key to use."""
    import subprocess
    import sys

    other = tmp_path / "other"
    for key, value, want in (
        ("data_dir", f'"{other}"', "the top-level data_dir (--data-dir)"),
        ("role", '"master"', "the top-level role (--role)"),
        ("max_delay_ms", "5", "limits.max_delay_ms"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "qdelay.cli", "server", "--data-dir", str(tmp_path / "data"), "--listen"]
            + ["127.0.0.1:0", "--set", f"engine.{key}={value}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode != 0 and "qdelay listening" not in result.stdout, (key, result.stdout)
        assert f"[engine] {key}: not an [engine] option; set {want} instead" in result.stderr, result.stderr
    assert not other.exists()
    with pytest.raises(ConfigError, match=r"known: ack_timeout_ms, checkpoint_interval_ms, cleaner_enabled, "):
        config_mod.engine_config(ack_timeout=1)


def test_main_flags_override_file(tmp_path):
    from qdelay.server import main

    path = tmp_path / "q.toml"
    path.write_text('listen = "127.0.0.1:9999"\ndata_dir = "from-file"\n[limits]\nmax_batch = 7\n')
    import argparse

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(
        [
            "--config",
            str(path),
            "--listen",
            "127.0.0.1:0",
            "--set",
            "limits.max_batch=9",
            "--set",
            "engine.flush=interval:5",
        ]
    )
    cfg = main.config_from_args(args)
    assert cfg.listen == "127.0.0.1:0" and cfg.data_dir == "from-file"
    assert cfg.limits.max_batch == 9 and cfg.engine_options["flush"] == "interval:5"
    args = parser.parse_args([])
    cfg = main.config_from_args(args)
    assert cfg.listen == "127.0.0.1:7600" and cfg.data_dir == "./data" and cfg.role == "master"


def test_the_lease_ttl_is_in_ms_a_multiple_of_1000_as_its_help_says():
    """``--lease-ttl-ms`` read "etcd lease TTL, whole seconds (default 5000)": a value in ms
    that said seconds. Help and refusal now say what the check is: ms, a multiple of 1000."""
    import argparse

    from qdelay.server import main

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    text = " ".join(next(a.help for a in parser._actions if a.dest == "lease_ttl_ms").split())
    assert "in ms, a multiple of 1000" in text and "(default 5000)" in text, text
    assert ServerConfig().lease_ttl_ms == 5000
    base = {"etcd": "127.0.0.1:2379", "cluster": "c", "shard": "s"}
    ServerConfig(**base, lease_ttl_ms=4000).validate()
    for ttl in (1500, 0, 999):
        with pytest.raises(ConfigError, match=f"lease_ttl_ms must be a multiple of 1000 .*, not {ttl}"):
            ServerConfig(**base, lease_ttl_ms=ttl).validate()


def test_bad_settings_are_refused_before_the_folder_is_opened(tmp_path):
    """Walking the operator's side: ``--set engine.ack_timeout_ms=abc`` (a bare word is a
    string) and ``--flush sometimes`` ended in a TypeError / ValueError traceback once the
    engine was opening the folder; an unknown [engine] key, a missing TLS key and a missing
    token file exited 1 after opening it (docs/api.md: a bad configuration exits 2), the TLS
    one as a bare ``[Errno 2] ... '/x'``; ``--log-level loud`` was taken silently. Each is
    now one line naming the key, exit 2, and the data folder is not created."""
    import subprocess
    import sys

    data = tmp_path / "data"
    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    empty_tokens = tmp_path / "tokens"
    empty_tokens.write_text("# no token yet\n\n")
    for args, want in (
        (["--set", "engine.ack_timeout_ms=abc"], "engine.ack_timeout_ms must be a non-negative integer, not 'abc'"),
        (["--set", "engine.cleaner_enabled=1"], "engine.cleaner_enabled must be true or false, not 1"),
        (["--flush", "sometimes"], "engine.flush (--flush): unknown flush policy 'sometimes'"),
        (["--set", "engine.scale_minutes=7"], "engine.scale_minutes must divide a day"),
        (["--set", "engine.tick_ms=0"], "engine.tick_ms must be a positive integer, not 0"),  # a traceback
        (["--set", "engine.cleaner_interval_ms=0"], "engine.cleaner_interval_ms must be a positive integer"),  # spun
        (["--set", "engine.nope=1"], "unknown [engine] option(s) nope"),
        (["--tls-cert", str(cert), "--tls-key", str(tmp_path / "gone.key")], "tls_key "),
        (["--auth-token-file", str(empty_tokens)], f"auth_token_file {empty_tokens} holds no token"),
        (["--log-level", "loud"], "log_level must be one of debug, info, warning, error, not 'loud'"),
        # top-level keys: an AttributeError traceback, and a server whose SIGTERM drain broke
        (["--set", "listen=7600"], "listen must be a string, not 7600"),
        (["--set", 'grace_seconds="10"'], "grace_seconds must be a non-negative number, not '10'"),
    ):
        cp = subprocess.run(
            [sys.executable, "-m", "qdelay.cli", "server", "--data-dir", str(data), "--listen", "127.0.0.1:0", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cp.returncode == 2 and cp.stdout == "", (args, cp.returncode, cp.stdout, cp.stderr)
        lines = cp.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("qdelay server: "), (args, cp.stderr)
        assert want in cp.stderr and "Traceback" not in cp.stderr, (args, cp.stderr)
        assert not data.exists(), args


def test_compact_receipts_need_every_message_id():
    batch = encode_messages([msg(message_id="a"), msg(message_id="b")], LIMITS, NOW, IdGenerator(), ids_required=True)
    assert batch.ids == ["a", "b"]
    with pytest.raises(errors.InvalidArgument, match=r"messages\[1\].message_id: required with compact_receipts"):
        encode_messages([msg(message_id="a"), msg()], LIMITS, NOW, IdGenerator(), ids_required=True)


def _one_by_one(request, limits=LIMITS):
    """validate_cancel_batch's reference: validate_receipt of each entry."""
    out = []
    for i, r in enumerate(request.requests):
        try:
            out.append(validate_receipt(r, limits))
        except errors.InvalidArgument as err:
            raise errors.InvalidArgument(f"requests[{i}].{err}") from None
    return out


@pytest.mark.parametrize(
    "odd",
    [
        None,
        pb.CancelRequest(message_id="by-id"),
        pb.CancelRequest(receipt=pb.Receipt(message_id="", deliver_at_ms=5, sequence=1)),
        pb.CancelRequest(receipt=pb.Receipt(message_id="x" * 200, deliver_at_ms=5, sequence=1)),
        pb.CancelRequest(receipt=pb.Receipt(message_id="caf\u00e9", deliver_at_ms=5, sequence=1)),
        pb.CancelRequest(receipt=pb.Receipt(message_id="tab\there", deliver_at_ms=5, sequence=1)),
        pb.CancelRequest(receipt=pb.Receipt(message_id="del\x7f", deliver_at_ms=5, sequence=1)),
        pb.CancelRequest(receipt=pb.Receipt(message_id="neg", deliver_at_ms=-1, sequence=1)),
        pb.CancelRequest(receipt=pb.Receipt(message_id="same", deliver_at_ms=5, sequence=1), message_id="same"),
        pb.CancelRequest(receipt=pb.Receipt(message_id="one", deliver_at_ms=5, sequence=1), message_id="other"),
        pb.CancelRequest(),
    ],
)
def test_cancel_batch_checked_as_columns_agrees_with_one_by_one(odd):
    """The whole-column check of a batch of receipts answers as validate_receipt of each
    entry does: the same targets, or the same refusal naming the same entry."""
    requests = [
        pb.CancelRequest(receipt=pb.Receipt(message_id=f"m {i}~", deliver_at_ms=i, sequence=i + 1)) for i in range(5)
    ]
    if odd is not None:
        requests.insert(3, odd)
    request = pb.CancelBatchRequest(requests=requests)
    try:
        want = _one_by_one(request)
    except errors.InvalidArgument as err:
        with pytest.raises(errors.InvalidArgument) as info:
            validate_cancel_batch(request, LIMITS)
        assert str(info.value) == str(err)
    else:
        assert validate_cancel_batch(request, LIMITS) == want
