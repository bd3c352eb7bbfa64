"""The gateway as an operated service: keys, back-pressure, Redis outages, health, metrics."""
from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.config import GatewayConfig
from shared.messages import SeqDelta
from shared.redis_keys import CONSUMER_GROUP
from tests.gateway.conftest import FakeScheduler, RedisProcess

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def test_api_keys_guard_v1_and_the_tokenizer_and_accept_any_configured_key(start_gateway):
    gw = start_gateway(api_keys=["key-one", "key-two"])
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"},
                        {"Authorization": "Basic key-one"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/completions", json=BODY)                 # refused before the body
        assert r.status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer key-two"}).status_code == 200
        for path in ("/ping", "/metrics", "/openapi.json"):
            assert c.get(path).status_code == 200
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert c.post(path, json=body).status_code == 401
            assert c.post(path, json=body,
                          headers={"Authorization": "Bearer key-one"}).status_code == 200


def test_queue_deeper_than_the_limit_is_429_with_retry_after(start_gateway, redis_proc):
    gw = start_gateway(max_queue=2, retry_after_s=3)
    keys = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    r = keys.r
    r.delete(keys.keys.requests)
    for _ in range(2):                      # two requests waiting, no scheduler group yet
        r.xadd(keys.keys.requests, {b"m": b"x"})
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        resp = c.post("/v1/completions", json=BODY)
        assert resp.status_code == 429 and resp.headers["retry-after"] == "3"
        assert resp.json()["error"]["code"] == "queue_full"
        assert r.xlen(keys.keys.requests) == 2            # the refused one was not added
        # a scheduler group that read both but finished neither: still 2 unfinished
        r.xgroup_create(keys.keys.requests, CONSUMER_GROUP, id="0")
        read = r.xreadgroup(CONSUMER_GROUP, "s", {keys.keys.requests: ">"}, count=10)
        assert c.post("/v1/completions", json=BODY).status_code == 429
        # both finished (acknowledged): the queue is empty again and requests go through
        r.xack(keys.keys.requests, CONSUMER_GROUP, *[i for i, _ in read[0][1]])
        with c.stream("POST", "/v1/completions", json=dict(BODY, stream=True)) as resp:
            assert resp.status_code == 200
        assert r.xlen(keys.keys.requests) == 3


def test_redis_outage_is_503_and_the_gateway_recovers_by_itself(start_gateway):
    rp = RedisProcess()
    rp.start()
    try:
        gw = start_gateway(redis_url=rp.url)
        sched = FakeScheduler(rp.url, gw.config.redis_prefix)
        sched.beat()
        with httpx.Client(base_url=gw.url, timeout=10) as c:
            assert c.get("/health").status_code == 200
            rp.stop()
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and r.headers["retry-after"]
            err = r.json()["error"]
            assert err["code"] == "redis_unavailable" and "did not answer" in err["message"]
            assert "Traceback" not in r.text
            health = c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            assert c.get("/ping").status_code == 200
            assert c.get("/metrics").status_code == 200
            rp.start()                                    # same port: no restart of the gateway
            sched = FakeScheduler(rp.url, gw.config.redis_prefix)
            sched.beat()
            assert c.get("/health").status_code == 200
            sched.serve_in_thread(lambda req: [([SeqDelta(0, [28], finish_reason="length")],
                                                True)])
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        rp.stop()


def test_health_needs_a_fresh_scheduler_heartbeat_that_is_not_degraded(start_gateway, redis_proc):
    gw = start_gateway()
    sched = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        r = c.get("/health")
        assert r.status_code == 503 and "no scheduler heartbeat" in r.json()["reason"]
        sched.r.hset(sched.keys.schedulers, "old", f"{time.time() - 30:.3f}")
        assert c.get("/health").status_code == 503
        sched.beat()
        r = c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "schedulers": ["fake"]}
        sched.r.hset(sched.keys.degraded, "fake", "executor lost: no answer for 2 s")
        r = c.get("/health")
        assert r.status_code == 503 and "executor lost" in r.json()["reason"]
        sched.r.hdel(sched.keys.degraded, "fake")
        assert c.get("/health").status_code == 200


def test_metrics_count_requests_and_merge_every_schedulers_exposition(start_gateway, redis_proc):
    gw = start_gateway()
    sched = FakeScheduler(redis_proc.url, gw.config.redis_prefix)
    for name, value in (("s1", 3), ("s2", 4)):
        sched.r.set(sched.keys.metrics(name),
                    "# HELP vllm:num_requests_running Running.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="m"}} {value}.0\n'
                    "# HELP pagedserve:gpu_blocks_used Used.\n"
                    "# TYPE pagedserve:gpu_blocks_used gauge\n"
                    f"pagedserve:gpu_blocks_used {value * 10}.0\n")
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        c.post("/v1/completions", content=b"{")
        c.get("/no/such/path")
        text = c.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}   # parses: valid
    samples = {(s.labels.get("endpoint"), s.labels.get("status")): s.value
               for s in families["pagedserve:gateway_requests"].samples
               if s.name.endswith("_total")}
    assert samples[("/v1/completions", "400")] == 1 and samples[("other", "404")] == 1
    running = families["vllm:num_requests_running"].samples
    assert {(s.labels["scheduler"], s.value) for s in running} == {("s1", 3.0), ("s2", 4.0)}
    assert text.count("# TYPE vllm:num_requests_running") == 1
    assert sum(s.value for s in families["pagedserve:gpu_blocks_used"].samples) == 70


def test_tokenize_and_detokenize_use_vllm_shapes(http, tokenizer):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 2048 and "".join(r["token_strs"]) == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True,
        return_dict=False)
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    assert http.post("/detokenize", json={"tokens": [10**7]}).status_code == 400


def test_models_and_openapi_describe_the_server(http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    doc = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/streams/{request_id}",
                 "/v1/models", "/tokenize", "/detokenize", "/health", "/ping", "/metrics",
                 "/version"):
        assert path in doc["paths"]
    schemas = doc["components"]["schemas"]
    # fields the server does not read are ignored, as vLLM ignores them
    assert "additionalProperties" not in schemas["CompletionRequest"]
    assert schemas["CompletionRequest"]["properties"]["logprobs"]["maximum"] == 20
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"]


def test_served_model_names_are_aliases_and_others_get_openais_404(start_gateway):
    gw = start_gateway(served_model_name=["team-model", "gpt-local"])
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["team-model",
                                                                         "gpt-local"]
        assert c.get("/v1/models/gpt-local").json()["id"] == "gpt-local"
        for name in (MODEL, "nope"):
            r = c.post("/v1/completions", json={"model": name, "prompt": "hi"})
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and err["param"] == "model"
            assert err["message"].startswith(f"The model `{name}` does not exist.")


def test_config_reads_flags_over_environment_over_defaults():
    env = {"PAGEDSERVE_MAX_QUEUE": "5", "PAGEDSERVE_API_KEYS": "a, b,", "REDIS_URL": "redis://h:1/0",
           "PAGEDSERVE_PORT": "9000"}
    cfg = GatewayConfig.from_argv(["--max-queue", "7"], env=env)
    assert (cfg.max_queue, cfg.api_keys, cfg.redis_url, cfg.port) == (7, ["a", "b"],
                                                                       "redis://h:1/0", 9000)
    assert GatewayConfig.from_argv([], env={}).host == "127.0.0.1"
