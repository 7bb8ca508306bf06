"""cluster.yaml: valid for Ray's own cluster-config schema, commented, free of credentials."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

CLUSTER_YAML = Path(__file__).resolve().parents[3] / "cluster.yaml"
KEY_LINE = re.compile(r"""^\s*(?:-\s+)?(?:"[^"]+"|[\w.~/-]+):(?:\s|$)""")


@pytest.fixture(scope="module")
def config():
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_validates_against_rays_schema(config):
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)


def test_passes_rays_own_config_checks(config):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


def test_node_types_place_decode_and_training(config):
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["CPU"] == 0, "decode and trainers stay off the head"
    ingest = types["ingest.cpu"]
    trainer = types["trainer.gpu"]
    assert ingest["resources"]["CPU"] > 0 and "GPU" not in ingest["resources"]
    assert trainer["resources"]["GPU"] > 0 and trainer["resources"]["trainer"] > 0
    for node in (ingest, trainer):
        assert node["min_workers"] < node["max_workers"], "autoscaling needs room"
        assert node["labels"]["raying/role"]
    assert {t["labels"]["raying/role"] for t in types.values()} == {"head", "ingest",
                                                                     "trainer"}


def test_setup_installs_raying_and_starts_with_token_auth(config):
    setup = " ".join(config["setup_commands"])
    assert "ray[data,default]==2.60.0" in setup and "raying" in setup
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any("RAY_AUTH_MODE=token" in c for c in config[key]), key
    assert any("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"])


def test_every_key_is_commented():
    lines = CLUSTER_YAML.read_text().splitlines()
    bare = []
    for n, line in enumerate(lines):
        if not KEY_LINE.match(line) or "#" in line:
            continue
        above = next((p.strip() for p in reversed(lines[:n]) if p.strip()), "")
        if not above.startswith("#"):
            bare.append(f"{n + 1}: {line.strip()}")
    assert bare == [], "keys without a comment:\n" + "\n".join(bare)


def test_holds_no_credentials():
    text = CLUSTER_YAML.read_text()
    for pattern in (r"AKIA[0-9A-Z]{12,}", r"(?i)secret_access_key\s*:", r"(?i)password\s*:",
                    r"(?i)aws_session_token", r"\b[0-9a-f]{64}\b", r"BEGIN [A-Z ]*PRIVATE KEY"):
        assert not re.search(pattern, text), pattern
