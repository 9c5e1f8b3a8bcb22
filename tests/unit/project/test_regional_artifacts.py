"""packaging/regional/ read as a platform team and an appliance would: well-formed, and agreeing with itself
and with the appliance's [regional] section (names, labels, ports, objectives, model)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from appliance.boot.config import RegionalSection, default_objectives

HERE = Path(__file__).resolve().parents[3] / "packaging" / "regional"


def manifests() -> list[dict]:
    docs = []
    for path in sorted(HERE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc and {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{path.name}: {doc}"
            docs.append(doc)
    return docs


def of_kind(kind: str) -> list[dict]:
    return [d for d in manifests() if d["kind"] == kind]


def one(kind: str) -> dict:
    found = of_kind(kind)
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


@pytest.fixture(scope="module")
def regional() -> RegionalSection:
    """The section an appliance loads, through the appliance's own validation."""
    return RegionalSection.model_validate(tomllib.loads((HERE / "appliance-regional.toml").read_text())["regional"])


def pods() -> dict[str, dict]:
    """llm-d.ai/role -> the pod template of that role's Deployment (the endpoint picker's has none)."""
    found = {}
    for d in of_kind("Deployment"):
        tpl = d["spec"]["template"]
        assert d["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items(), d["metadata"]
        if role := tpl["metadata"]["labels"].get("llm-d.ai/role"):
            found[role] = tpl
    return found


def containers(tpl: dict) -> list[dict]:
    return tpl["spec"]["containers"] + tpl["spec"].get("initContainers", [])


def arg(container: dict, flag: str) -> str | None:
    args = container.get("args", [])
    for i, a in enumerate(args):
        if a.startswith(f"{flag}="):
            return a.split("=", 1)[1]
        if a == flag:
            return args[i + 1]
    return None


def test_every_manifest_is_well_formed_and_names_are_unique():
    names = [(d["kind"], d["metadata"]["name"]) for d in manifests()]
    assert len(names) == len(set(names)), names
    assert {k for k, _ in names} >= {"InferencePool", "InferenceObjective", "Deployment", "Gateway", "HTTPRoute"}


def test_the_pool_selects_both_roles_on_a_port_each_pod_serves():
    pool = one("InferencePool")["spec"]
    roles = pods()
    assert set(roles) == {"prefill", "decode"}
    (port,) = [p["number"] for p in pool["targetPorts"]]
    for role, tpl in roles.items():
        assert pool["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items(), role
        served = {p["containerPort"] for c in containers(tpl) for p in c.get("ports", [])}
        assert port in served, f"{role} pods serve {served}, the pool targets {port}"
    decode_vllm = next(c for c in roles["decode"]["spec"]["containers"] if c["name"] == "vllm")
    sidecar = next(c for c in containers(roles["decode"]) if c["name"] == "routing-proxy")
    assert arg(sidecar, "--port") == str(port) and arg(sidecar, "--vllm-port") == arg(decode_vllm, "--port")


def test_the_endpoint_picker_serves_the_pool_with_p_d_profiles():
    pool = one("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = next(s for s in of_kind("Service") if s["metadata"]["name"] == ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    epp = next(d for d in of_kind("Deployment") if d["spec"]["template"]["metadata"]["labels"].items()
               >= service["spec"]["selector"].items())
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    assert arg(container, "--pool-name") == pool["metadata"]["name"]
    config_map = next(c for c in of_kind("ConfigMap")
                      if c["metadata"]["name"] == epp["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][Path(arg(container, "--config-file")).name])
    assert {p["name"] for p in config["schedulingProfiles"]} == {"prefill", "decode"}
    assert "pd-profile-handler" in {p["type"] for p in config["plugins"]}


def test_the_objectives_are_the_appliance_classes_on_this_pool(regional: RegionalSection):
    objectives = {o["metadata"]["name"]: o["spec"] for o in of_kind("InferenceObjective")}
    assert set(objectives) == set(regional.objectives.values()) == set(default_objectives().values())
    assert all(o["poolRef"]["name"] == one("InferencePool")["metadata"]["name"] for o in objectives.values())
    gold, silver, bronze = (objectives[regional.objectives[c]]["priority"] for c in ("gold", "silver", "bronze"))
    assert gold > silver > bronze


def test_every_model_server_serves_the_model_the_appliances_name(regional: RegionalSection):
    for role, tpl in pods().items():
        vllm = next(c for c in tpl["spec"]["containers"] if c["name"] == "vllm")
        assert arg(vllm, "--served-model-name") == regional.model, role
        assert '"kv_role":"kv_both"' in re.sub(r"\s", "", arg(vllm, "--kv-transfer-config") or ""), role


def test_the_appliances_reach_the_gateway_and_its_route(regional: RegionalSection):
    url = urlsplit(regional.base_url)
    gateway, route = one("Gateway"), one("HTTPRoute")
    (listener,) = gateway["spec"]["listeners"]
    assert (url.scheme, url.hostname, url.port or 443) == ("https", listener["hostname"], listener["port"])
    assert listener["protocol"] == "HTTPS"
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    assert url.hostname in route["spec"]["hostnames"]
    (rule,) = route["spec"]["rules"]
    assert url.path.startswith(rule["matches"][0]["path"]["value"])
    (backend,) = rule["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", one("InferencePool")["metadata"]["name"])
    assert int(rule["timeouts"]["request"].rstrip("s")) > regional.read_timeout_s
    assert regional.llm_d_headers
