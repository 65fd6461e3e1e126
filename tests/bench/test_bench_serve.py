"""`qwick bench serve` against a real server on a tiny model: every request counted, latencies reported."""

from __future__ import annotations

import json

from qwick.entrypoints.cli import main
from tests.server.harness import TINY_ENGINE_ARGS, ServerThread


def test_bench_serve_reports_throughput_and_latencies(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "serve.json"
    with ServerThread([tiny_qwen2_dir, *TINY_ENGINE_ARGS]) as server:
        args = [
            "bench",
            "serve",
            "--url",
            server.url,
            "--num-prompts",
            "6",
            "--concurrency",
            "3",
            "--input-len",
            "10",
            "--output-len",
            "5",
            "--vocab-size",
            "300",
            "--output-json",
            str(out),
        ]
        assert main(args) == 0
        generated = server.metric("qwick:generation_tokens_total")
    result = json.loads(out.read_text())["result"]["server"]
    assert result["output_tokens_per_s"] == (6 * 5) / result["seconds"]
    assert generated >= 6 * 5  # the server really generated every token (plus the warm-up's)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < result[key]["p50"] <= result[key]["p99"]


def test_bench_serve_without_a_server_is_a_clean_error(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "could not benchmark the server" in capsys.readouterr().err
