"""Test-only stand-in of an SGLang HTTP server (never imported by fastverify): the endpoints
``launch --baseline`` uses, with deterministic answers, and ways to misbehave.

    python fake.py PORT MODE

MODE: ``ok``; ``never`` (``/health_generate`` answers 503 for ever); ``die-after-N`` (exit 3 after N
``/generate`` requests); ``shift`` (prompt ``p01``'s token 3 differs from :func:`answer`'s). Writes
its pid to ``$FAKE_PID_FILE`` when set.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

N_TOKENS = 8


def answer(prompt: str, n: int) -> dict:
    """The reply to ``prompt``: ids from its characters, logprob -0.1 and a margin of 3 nats each."""
    ids = [(ord(c) * 7 + i) % 500 for i, c in enumerate((prompt * n)[:n])]
    return {
        "text": "x" * n,
        "output_ids": ids,
        "meta_info": {
            "output_token_logprobs": [[-0.1, t, None] for t in ids],
            "output_top_logprobs": [[[-0.1, t, None], [-3.1, t + 1, None]] for t in ids],
            "completion_tokens": n,
            "spec_verify_ct": max(1, n // 2),
        },
    }


class Handler(BaseHTTPRequestHandler):
    mode = "ok"
    generated = 0

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health_generate":
            self._send(503 if Handler.mode == "never" else 200, {})
        elif self.path == "/server_info":
            self._send(200, {"device": "cpu", "dtype": "float32", "tp_size": 1, "model_path": "fake"})
        else:
            self._send(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.generated += 1
        mode = Handler.mode
        if mode.startswith("die-after-") and Handler.generated > int(mode.rsplit("-", 1)[1]):
            os._exit(3)
        reply = answer(body["text"], body["sampling_params"]["max_new_tokens"])
        if mode == "shift" and body["text"].startswith("List three"):
            reply["output_ids"][3] += 1
        self._send(200, reply)


def main() -> None:
    port, Handler.mode = int(sys.argv[1]), sys.argv[2]
    if os.environ.get("FAKE_PID_FILE"):
        with open(os.environ["FAKE_PID_FILE"], "w") as f:
            f.write(str(os.getpid()))
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
