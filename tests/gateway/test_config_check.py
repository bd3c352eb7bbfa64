"""GatewayConfig.check: the ranges a gateway refuses to start with."""
from __future__ import annotations

import dataclasses

import pytest

from services.gateway import config as gconfig
from services.gateway.config import GatewayConfig

NUMERIC = [f.name for f in dataclasses.fields(GatewayConfig)
           if type(f.default) in (int, float)]


def test_the_defaults_pass():
    GatewayConfig().check()


@pytest.mark.parametrize("name", NUMERIC)
def test_each_number_has_its_floor(name):
    """Counts that would refuse every request need 1, timeouts more than 0, the rest 0;
    the message names the flag."""
    kind = type(getattr(GatewayConfig(), name))
    floor = 1 if name in gconfig._AT_LEAST_ONE else 0
    strict = name in gconfig._POSITIVE
    flag = "--" + name.replace("_", "-")
    below = kind(floor - 1) if not strict else kind(0)
    with pytest.raises(ValueError, match=f"^{flag} must be "):
        dataclasses.replace(GatewayConfig(), **{name: below}).check()
    ok = kind(floor) if not strict else kind(0.5 if kind is float else 1)
    dataclasses.replace(GatewayConfig(), **{name: ok}).check()
