"""bench autoscale's two sides: `sequences` is local.yaml as it is; `micro-batches` is it with Serve's
own rule on micro-batches and a fixed request limit, as local.yaml had before."""
from __future__ import annotations

from bench.autoscale_bench import decoder_override, side_args
from bench.serve_bench import app_args, local_app


def test_the_sequences_side_is_local_yaml_as_it_is():
    decoder = next(d for d in local_app()["deployments"] if d["name"] == "Decoder")
    assert decoder_override("sequences") == decoder
    assert decoder["autoscaling_config"]["policy"]["policy_function"] == "deployments.autoscaling:SequenceLoadPolicy"
    args = side_args("sequences")
    assert args["dispatch"] == app_args(predictor=False)["dispatch"] and args["dispatch"]["requests_per_replica"]
    assert args["limits"]["stop_on_loop"] is False and args["predictor"] is None


def test_the_micro_batches_side_counts_micro_batches_and_keeps_a_fixed_limit():
    decoder = decoder_override("micro-batches")
    scaling = decoder["autoscaling_config"]
    assert "policy" not in scaling and scaling["target_ongoing_requests"] == 1
    assert scaling["max_replicas"] == 2 and decoder["max_ongoing_requests"] == 32
    dispatch = side_args("micro-batches")["dispatch"]
    assert "requests_per_replica" not in dispatch and dispatch["max_requests_in_flight"] == 32


def test_threads_sets_every_decoder_replicas_torch_threads_on_both_sides():
    assert side_args("sequences", threads=3)["engine"]["num_threads"] == 3
    assert side_args("micro-batches", threads=3)["engine"]["num_threads"] == 3
    assert side_args("sequences")["engine"]["num_threads"] == app_args(predictor=False)["engine"]["num_threads"]
