"""Engines of a RolloutPool serve HTTP from inside their Ray actors; HTTP and Ray requests share one batch."""

import pytest
import ray
import requests
from helpers import wait_until_decoding

from miles_ray import placement
from miles_ray.actors import RolloutPool, RolloutPoolConfig
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.engines.http_server import HttpServerConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams

pytestmark = pytest.mark.e2e


def test_pool_engines_serve_openai_and_ray_at_once(make_placement, tiny_model_path):
    from openai import OpenAI

    pl = make_placement(placement.colocated(2))
    config = RolloutPoolConfig(
        num_engines=2,
        engine=EmbeddedEngineConfig(model_path=tiny_model_path, max_seq_len=1600),
        http=HttpServerConfig(api_key="secret"),
        served_model_name="tiny",
    )
    pool = RolloutPool.remote(config, pl)
    urls = ray.get(pool.urls.remote())
    engines = ray.get(pool.engines.remote())
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    assert [h["url"] for h in ray.get([e.health.remote() for e in engines])] == urls

    # a long Ray request is running on engine 0 when an OpenAI chat request arrives over HTTP
    long = engines[0].generate.remote(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=1500, ignore_eos=True)))
    wait_until_decoding(engines[0])
    client = OpenAI(base_url=f"{urls[0]}/v1", api_key="secret")
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20)
    assert resp.model == "tiny" and len(resp.choices[0].token_ids) <= 20 and resp.prompt_token_ids
    # the chat request joined the running batch and left it: it did not wait for the long one
    assert ray.wait([long], timeout=0)[0] == []
    assert len(ray.get(long).completions[0].token_ids) == 1500
    assert requests.get(f"{urls[1]}/health", timeout=5).status_code == 401  # the token guards every route
    assert ray.get(pool.api_key.remote()) == "secret"
