"""Protocol revision 2: version negotiation, programs served by the
gateway, enrolment URIs and token rotation/revocation without restart."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import pytest
from bridge_fakes import (
    running_bridge,
    self_signed,
    task_identity,  # noqa: F401 (fixture)
)
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from flowerbed.clients.bridge.enroll import (
    EnrolmentError,
    enrolment_uri,
    issue_token,
    qr_text,
    revoke,
    spki_pin,
)
from flowerbed.clients.bridge.programs import ProgramError, load_program
from flowerbed.clients.bridge.simphone import SimPhone
from flowerbed.clients.bridge.tokens import TokenTable, hash_token, load_tokens

pytestmark = pytest.mark.usefixtures("task_identity")

PTE = b"\x00\x00\x00\x00ET12" + bytes(range(256)) * 4  # stands in for a .pte


def _write_program(tmp_path, params=None, name="tiny", data=PTE):
    pte = tmp_path / f"{name}.pte"
    pte.write_bytes(data)
    meta = {
        "model": name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "min_runtime": "1.5.1",
        "parameters": params
        or [{"name": "fc.weight", "shape": [2, 3]}, {"name": "fc.bias", "shape": [2]}],
    }
    (tmp_path / f"{name}.pte.json").write_text(json.dumps(meta))
    return pte


@pytest.mark.parametrize(
    ("protocols", "agreed"), [((1,), None), ((1, 2), 2), ((2,), 2), ((1, 2, 7), 2)]
)
def test_hello_agrees_on_the_newest_common_revision(protocols, agreed):
    with running_bridge() as (_, _, _, phone):
        info = phone("alice").hello(protocols=protocols)
        assert info.get("protocol") == agreed  # revision 1 answers stay as they were
        if agreed:
            assert info["supported"] == [1, 2]


def test_a_phone_too_old_or_too_new_is_told_to_update():
    with running_bridge() as (_, _, _, phone):
        resp = phone("alice").post_json("/v1/hello", {"protocol": 7, "protocols": [7]})
    assert resp.status == 426
    assert resp.json()["supported"] == [1, 2] and resp.json()["update"] is True
    assert "update the flowerbed app" in resp.json()["error"]


def test_a_program_is_described_in_tasks_and_served_resumably(tmp_path):
    program = load_program(_write_program(tmp_path))
    with running_bridge(programs=(program,)) as (flower, _, server, _):
        alice = SimPhone(server.url, "tok-alice-0123456789", timeout=10)
        try:
            node = alice.hello(protocols=(1, 2))["node_id"]
            flower.send(node, "train", {"lr": 0.1})
            task = alice.poll(2)
            assert task["program"] == {
                "name": "tiny",
                "sha256": hashlib.sha256(PTE).hexdigest(),
                "bytes": len(PTE),
                "min_runtime": "1.5.1",
                "url": f"/v1/program/{hashlib.sha256(PTE).hexdigest()}",
                "parameters": [
                    {"name": "fc.weight", "shape": [2, 3]},
                    {"name": "fc.bias", "shape": [2]},
                ],
            }
            whole = alice.request("GET", task["program"]["url"])
            assert (whole.status, whole.body) == (200, PTE)
            tail = alice.request(
                "GET", task["program"]["url"], headers={"Range": "bytes=1000-"}
            )
            assert (tail.status, tail.body) == (206, PTE[1000:])
            assert alice.request("GET", "/v1/program/" + "0" * 64).status == 404
        finally:
            alice.close()


def test_tasks_that_do_not_fit_the_program_or_the_phone_become_error_replies(
    tmp_path,
):
    wrong = load_program(
        _write_program(
            tmp_path,
            params=[{"name": "fc.weight", "shape": [3, 2]}],
            name="wrong",
            data=PTE[::-1],
        )
    )
    right = load_program(_write_program(tmp_path, name="right"))
    with running_bridge(programs=(right, wrong)) as (flower, _, server, _):
        new = SimPhone(server.url, "tok-alice-0123456789", timeout=10)
        old = SimPhone(server.url, "tok-bob-000123456789", timeout=10)
        try:
            node = new.hello(protocols=(1, 2))["node_id"]
            flower.send(node, "train", {"program": "wrong"})
            reason = flower.reply().error.reason
            assert "arrays do not match program 'wrong'" in reason
            assert "unexpected ['fc.bias']" in reason
            assert "fc.weight [2, 3] (program: [3, 2])" in reason
            flower.send(node, "train", {"program": "nope"})
            assert "names no program" in flower.reply().error.reason
            flower.send(old.hello()["node_id"], "train", {})
            assert "speaks protocol 1" in flower.reply().error.reason
        finally:
            new.close()
            old.close()


def test_the_input_shape_and_batch_limit_reach_the_phone_when_exported(tmp_path):
    pte = _write_program(tmp_path)
    meta = json.loads((tmp_path / "tiny.pte.json").read_text())
    meta.update(input=[1, 8, 8], max_batch_size=16)
    (tmp_path / "tiny.pte.json").write_text(json.dumps(meta))
    described = load_program(pte).describe()
    assert (described["input"], described["max_batch_size"]) == ([1, 8, 8], 16)


def test_the_state_and_the_evaluation_method_reach_the_phone_and_are_checked(tmp_path):
    """A program that trains batch norm carries its running statistics as state: the
    task's arrays must be its parameters and its state, and the phone is told which
    are which, the smallest batch and the evaluation method."""
    pte = _write_program(tmp_path)
    meta = json.loads((tmp_path / "tiny.pte.json").read_text())
    meta.update(
        state=[{"name": "bn.running_mean", "shape": [2]}],
        evaluate_method="evaluate",
        min_batch_size=2,
    )
    (tmp_path / "tiny.pte.json").write_text(json.dumps(meta))
    program = load_program(pte)
    described = program.describe()
    assert described["state"] == [{"name": "bn.running_mean", "shape": [2]}]
    assert described["evaluate_method"] == "evaluate"
    assert described["min_batch_size"] == 2
    program.check_arrays(
        [("fc.weight", (2, 3)), ("bn.running_mean", (2,)), ("fc.bias", (2,))]
    )
    with pytest.raises(ProgramError, match=r"missing \['bn.running_mean'\]"):
        program.check_arrays([("fc.weight", (2, 3)), ("fc.bias", (2,))])
    assert (
        "state" not in load_program(_write_program(tmp_path, name="plain")).describe()
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"state": [{"name": "fc.bias", "shape": [2]}]}, "must appear once"),
        ({"state": {"name": "x"}}, "lists"),
        ({"evaluate_method": 3}, "evaluate_method must be a string"),
        ({"min_batch_size": 0}, "min_batch_size must be an integer >= 1"),
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer >= 1"),
    ],
)
def test_metadata_with_bad_state_or_batch_fields_is_refused(tmp_path, change, message):
    pte = _write_program(tmp_path)
    meta = json.loads((tmp_path / "tiny.pte.json").read_text())
    meta.update(change)
    (tmp_path / "tiny.pte.json").write_text(json.dumps(meta))
    with pytest.raises(ProgramError, match=message):
        load_program(pte)


def test_a_program_changed_after_export_is_refused(tmp_path):
    pte = _write_program(tmp_path)
    pte.write_bytes(PTE + b"tampered")
    with pytest.raises(ProgramError, match="changed after export"):
        load_program(pte)
    (tmp_path / "tiny.pte.json").write_text("[]")
    with pytest.raises(ProgramError, match="JSON object"):
        load_program(pte)


# -- enrolment ---------------------------------------------------------------------


def test_enrolment_writes_only_the_hash_and_the_gateway_takes_it_at_once(tmp_path):
    path = tmp_path / "tokens.txt"
    token = issue_token(path, "pixel-7")
    assert len(token) == 43  # 32 random bytes, URL-safe base64
    assert path.read_text() == f"{hash_token(token)} pixel-7\n"
    assert path.stat().st_mode & 0o777 == 0o600
    table = TokenTable.from_file(path, check_interval_s=0.0)
    with running_bridge(tokens=table) as (_, _, server, _):
        phone = SimPhone(server.url, token, timeout=10)
        node = phone.hello()["node_id"]
        second = issue_token(path, "a52")  # enrolled while the gateway runs
        assert SimPhone(server.url, second, timeout=10).hello()["phone"] == "a52"
        rotated = issue_token(path, "pixel-7", rotate=True)
        assert phone.post_json("/v1/hello", {"protocol": 1}).status == 401
        phone.token = rotated
        assert phone.hello()["node_id"] == node
        revoke(path, "pixel-7")
        revoke(path, "a52")  # every phone revoked: the empty table applies
        time.sleep(0.05)
        assert phone.post_json("/v1/hello", {"protocol": 1}).status == 401
        phone.close()
    assert load_tokens(path, allow_empty=True) == {}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: issue_token(p, "pixel-7"), "already enrolled"),
        (lambda p: issue_token(p, "s23", rotate=True), "no phone 's23'"),
        (lambda p: revoke(p, "s23"), "no phone 's23'"),
        (lambda p: issue_token(p, "bad name"), "phone name 'bad name'"),
    ],
)
def test_enrolment_errors_name_the_phone_and_leave_the_file_alone(
    tmp_path, call, message
):
    path = tmp_path / "tokens.txt"
    issue_token(path, "pixel-7")
    before = path.read_text()
    with pytest.raises(ValueError, match=message):
        call(path)
    assert path.read_text() == before


def test_the_enrolment_uri_carries_url_phone_token_and_pin(tmp_path):
    cert, _ = self_signed(tmp_path)
    pem = Path(cert).read_bytes()
    spki = (
        x509.load_pem_x509_certificate(pem)
        .public_key()
        .public_bytes(
            serialization.Encoding.DER,
            serialization.PublicFormat.SubjectPublicKeyInfo,
        )
    )
    pin = "sha256/" + base64.b64encode(hashlib.sha256(spki).digest()).decode()
    assert spki_pin(pem) == pin
    uri = enrolment_uri("https://10.0.0.5:8470/", "pixel-7", "tok_en-1", pin)
    assert uri == (
        "flowerbed://enroll?v=1&gateway=https%3A%2F%2F10.0.0.5%3A8470"
        f"&phone=pixel-7&token=tok_en-1&pin={quote(pin, safe='')}"
    )
    assert parse_qs(urlsplit(uri).query)["pin"] == [pin]
    with pytest.raises(EnrolmentError, match="needs an https"):
        enrolment_uri("http://10.0.0.5:8470", "pixel-7", "t", pin)
    with pytest.raises(EnrolmentError, match="must be http"):
        enrolment_uri("10.0.0.5:8470", "pixel-7", "t", None)


def test_enroll_command_prints_the_uri_and_a_qr_code(tmp_path, capsys):
    pytest.importorskip("qrcode")
    path = tmp_path / "tokens.txt"
    assert (
        cli_main(
            [
                "bridge",
                "enroll",
                "--tokens",
                str(path),
                "--phone",
                "p1",
                "--url",
                "http://h:1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    uri = next(line for line in out.splitlines() if line.startswith("flowerbed://"))
    token = uri.split("token=")[1]
    assert load_tokens(path) == {hash_token(token): "p1"}
    assert qr_text(uri) in out
    # A bad URL is refused before the token file is touched.
    assert (
        cli_main(
            ["bridge", "enroll", "--tokens", str(path), "--phone", "p2", "--url", "h:1"]
        )
        == 2
    )
    assert load_tokens(path) == {hash_token(token): "p1"}


def cli_main(argv):
    from flowerbed.cli import main

    return main(argv)
