"""The serving flags of `pdserve up` (issue 21, point 2): --served-model-name, --host and --http-port reach the gateway's
command line, --api-key only the gateway's environment, and --device/--prefill-device/--decode-device each instance's
own command line; the services' --device is checked before anything loads. The launcher's processes are replaced by
recorders: nothing starts."""
from __future__ import annotations

import argparse

import pytest
import torch

from pdserve import cli, launcher
from pdserve.common.cli_args import check_device, device_arg


def up_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["up"]).parse_args(["up", *argv])


def started(monkeypatch, *argv: str) -> dict[str, tuple[list[str], dict]]:
    """{instance name: (its pdserve argv, the env the launcher was asked to add)} for `pdserve up ARGV`."""
    seen = {}

    def record(name, args, env=None, *a, **k):
        seen[name] = (args, env or {})
        proc = launcher.Proc(name, args, popen=None, port=1)
        return proc
    monkeypatch.setattr(launcher, "start", record)
    monkeypatch.setattr(launcher, "launch", record)
    monkeypatch.setattr(launcher, "wait_ready", lambda p, *a: p)
    args = up_args(*argv)
    launcher.start_stack(args.model, insecure=True, **cli._up_stack(args))
    return seen


def flag(argv: list[str], name: str) -> list[str]:
    """Every value the flag is given in argv (nargs='+' flags: the words up to the next flag)."""
    out = []
    for i, a in enumerate(argv):
        if a == name:
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                out.append(argv[j])
                j += 1
    return out


def test_the_gateway_gets_the_names_host_and_port_and_the_key_only_by_its_environment(monkeypatch):
    seen = started(monkeypatch, "--served-model-name", "org/model", "alias", "--host", "0.0.0.0",
                   "--http-port", "8080", "--api-key", "sk-secret-0001")
    gw, env = seen["gateway"]
    assert flag(gw, "--served-model-name") == ["org/model", "alias"]
    assert flag(gw, "--host") == ["0.0.0.0"] and flag(gw, "--http-port") == ["8080"]
    assert env == {"PDSERVE_API_KEY": "sk-secret-0001"}
    for name, (argv, env) in seen.items():
        assert "sk-secret-0001" not in " ".join(argv), name  # never on a command line
        if name != "gateway":
            assert "PDSERVE_API_KEY" not in env and "--served-model-name" not in argv, name
            assert flag(argv, "--host") == [], name  # internal services keep their loopback default


def test_without_the_flags_the_gateway_keeps_its_defaults(monkeypatch):
    gw, env = started(monkeypatch)["gateway"]
    assert flag(gw, "--http-port") == [] and flag(gw, "--served-model-name") == [] and env == {}
    assert flag(gw, "--host") == ["127.0.0.1"] and "--allow-unauthenticated" not in gw


def test_allow_unauthenticated_reaches_the_gateway_alone(monkeypatch):
    seen = started(monkeypatch, "--host", "0.0.0.0", "--allow-unauthenticated")
    assert {name for name, (argv, _) in seen.items() if "--allow-unauthenticated" in argv} == {"gateway"}


def test_each_instance_gets_its_own_device(monkeypatch):
    seen = started(monkeypatch, "--prefill-instances", "2", "--decode-instances", "3", "--device", "cuda:0",
                   "--decode-device", "cuda:1,cuda:2,cuda:3")
    assert {n: flag(a, "--device") for n, (a, _) in seen.items()} == {
        "broker": [], "gateway": [], "prefill0": ["cuda:0"], "prefill1": ["cuda:0"],
        "decode0": ["cuda:1"], "decode1": ["cuda:2"], "decode2": ["cuda:3"]}


def test_one_device_for_a_role_goes_to_all_its_instances_and_none_leaves_the_services_default(monkeypatch):
    seen = started(monkeypatch, "--decode-instances", "2", "--prefill-device", "cpu")
    assert {n: flag(a, "--device") for n, (a, _) in seen.items() if n != "broker" and n != "gateway"} == {
        "prefill0": ["cpu"], "decode0": [], "decode1": []}


@pytest.mark.parametrize("argv, message", [
    (["--decode-instances", "2", "--decode-device", "cuda:0,cuda:1,cuda:2"],
     "--decode-device cuda:0,cuda:1,cuda:2 names 3 devices for 2 decode instances: give one for all of them or one "
     "per instance"),
    (["--prefill-device", "cuda:0,gpu"], "--prefill-device cuda:0,gpu: must be cpu, cuda or cuda:N, got 'gpu'"),
    (["--prefill-device", "cpu,"], "--prefill-device cpu,: must be cpu, cuda or cuda:N, got ''"),
    (["--api-key", " "], "--api-key is empty"),
])
def test_bad_device_lists_and_an_empty_key_are_refused_with_the_numbers(argv, message, capsys):
    assert cli.main(["up", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"pdserve up: {message}"


def test_the_launcher_refuses_a_device_list_of_the_wrong_length():
    with pytest.raises(ValueError, match="1 decode devices for 2 decode instances"):
        launcher.start_stack("m", num_decode=2, devices={"decode": ["cpu"]}, insecure=True)


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_torch_takes(text):
    assert device_arg(text) == text and torch.device(text).type in ("cpu", "cuda")


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "CUDA", "cuda:0,cuda:1", "mps", ""])
def test_other_device_names_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="must be cpu, cuda or cuda:N"):
        device_arg(text)


def test_a_cuda_device_the_host_lacks_stops_the_service_with_the_count(monkeypatch):
    check_device("decode", None)
    check_device("decode", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(SystemExit) as e:
        check_device("decode", "cuda")
    assert str(e.value) == f"decode: --device cuda: torch {torch.__version__} sees 0 CUDA device(s) here"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    check_device("prefill", "cuda:1")
    with pytest.raises(SystemExit) as e:
        check_device("prefill", "cuda:2")
    assert str(e.value) == (f"prefill: --device cuda:2: torch {torch.__version__} sees 2 CUDA device(s) here "
                            "(cuda:0..cuda:1), CUDA_VISIBLE_DEVICES='4,5'")


def test_up_without_the_model_names_the_cache_it_looked_in(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["up", "--model", "acme/absent-7b"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdserve up: --model acme/absent-7b: no local directory") and \
        f"the Hugging Face hub cache {tmp_path / 'hub'} (HF_HUB_CACHE, else HF_HOME/hub) has no " \
        "models--acme--absent-7b/" in err
    assert cli.main(["up"]) == 1  # the default model, not made yet: the hint says how
    assert "or write a random one: `pdserve make-model --out models/pdserve-tiny`" in capsys.readouterr().err
