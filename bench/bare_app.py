"""A reference row for ``bench.bench_http``: a bare FastAPI endpoint on the same HTTP stack.

``POST /v1/score`` parses and validates the body as the scoring service does (the same
pydantic ``Transaction``, straight from bytes) and answers fixed bytes: the floor of
FastAPI + uvicorn. The goals' ceiling is ``bench.typical_app``, an endpoint written the
way users write one (body parameter, ``response_model``).

    FRAUD_PORT=8001 python -m bench.bare_app
"""

from __future__ import annotations

import os

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from fraud_scoring.events import Transaction

app = FastAPI()

ANSWER = b'{"decision":"approve","score":0.0,"reasons":[],"model_version":"bare"}'


@app.post("/v1/score")
async def score(request: Request) -> Response:
    Transaction.model_validate_json(await request.body())
    return Response(ANSWER, media_type="application/json")


@app.get("/readyz")
async def readyz() -> dict[str, str]:
    return {"status": "ready"}


if __name__ == "__main__":
    uvicorn.run(
        app,
        host=os.environ.get("FRAUD_HOST", "127.0.0.1"),
        port=int(os.environ.get("FRAUD_PORT", "8001")),
        log_level="warning",
        access_log=False,
    )
