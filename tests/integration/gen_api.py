"""What the generation API tests share: an API serving a generation model's checks,
a Server-Sent Events reader, and the worker's writes played by hand.

:class:`PlayedWorker` writes what the generation worker writes, the way it
writes it (the job's row, its events stream, the done channel), so the
API's side can be tested against the real stream and the real database
without a model. It is for the tests of the API alone; the end-to-end tests
run the real worker.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from api.state import app_state
from core.config.settings import Settings
from core.db.schema import Job, utcnow
from core.db.terminal import after_terminal
from core.models.reader import load_repository
from core.streams.events import JobEvent
from core.streams.protocol import done_channel, events_key
from harness.served import Served, served
from tests.causal_lm_files import catalog_spec, write_model
from tests.models import REPOSITORY

MODEL = "tiny-lm"


@contextmanager
def generation_api(settings: Settings, tmp_path: Path) -> Iterator[Served]:
    """The API in uvicorn, with the sim model and a generation model's checks (no backend)."""
    root = tmp_path / "repository"
    shutil.copytree(REPOSITORY / "sim", root / "sim")
    write_model(root, MODEL, context_tokens=64)
    changed = settings.model_copy(
        update={"model_repository": root, "models": "sim", "model_parameters": {}}
    )
    with served(changed) as running:
        model = load_repository(root, environ={})[MODEL]
        app_state(running.app).catalog[MODEL] = catalog_spec(model)
        yield running


@dataclass
class Message:
    """One Server-Sent Event as a client reads it."""

    event: str | None = None
    data: Any = None
    id: str | None = None


@dataclass
class EventReader:
    """Reads messages off a streaming response; counts the comment lines (keep-alives)."""

    response: httpx.Response
    comments: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lines = self.response.iter_lines()

    def next(self) -> Message | None:
        """The next message; None at the end of the stream."""
        message = Message()
        seen = False
        for line in self.lines:
            if line == "":
                if seen:
                    return message
                continue
            if line.startswith(":"):
                self.comments.append(line[1:].strip())
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            seen = True
            if name == "event":
                message.event = value
            elif name == "id":
                message.id = value
            elif name == "data":
                message.data = json.loads(value) if value != "[DONE]" else value
        return message if seen else None

    def all(self) -> list[Message]:
        out = []
        while (message := self.next()) is not None:
            out.append(message)
        return out


@dataclass
class PlayedWorker:
    """The generation worker's writes for one job, by hand."""

    client: redis.Redis
    sessions: sessionmaker[Session]
    prefix: str
    job_id: str
    model: str = MODEL
    ttl_s: int = 3600
    ids: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return events_key(self.prefix, self.model, self.job_id)

    def _add(self, event: JobEvent) -> str:
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xadd(self.key, event.encode())  # type: ignore[arg-type]
            pipe.expire(self.key, self.ttl_s)
            entry_id = str(pipe.execute()[0])
        self.ids.append(entry_id)
        return entry_id

    def start(self) -> str:
        with self.sessions.begin() as session:
            session.execute(
                update(Job)
                .where(Job.id == self.job_id)
                .values(status="running", started_at=utcnow(), attempts=1)
            )
        return self._add(JobEvent.running())

    def token(self, index: int, token: int, text: str) -> str:
        return self._add(JobEvent.token_event(index, token, text))

    def finish(
        self,
        tokens: list[tuple[int, str]],
        finish_reason: str = "length",
        status: str = "succeeded",
        prompt_tokens: int = 3,
    ) -> str:
        """Commit the row with its output, then the done event, then the done channel."""
        now = utcnow()
        output = {
            "text": "".join(text for _, text in tokens),
            "token_ids": [token for token, _ in tokens],
            "finish_reason": finish_reason,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(tokens),
                "total_tokens": prompt_tokens + len(tokens),
            },
            "seed": None,
            "timings": {"queue_ms": 1.0, "ttft_ms": 2.0, "tpot_ms": 0.5},
        }
        with self.sessions.begin() as session:
            session.execute(
                update(Job)
                .where(Job.id == self.job_id)
                .values(status=status, finished_at=now, output=output)
            )
            after_terminal(session, [self.job_id], now)
        entry_id = self._add(JobEvent.done(status, finish_reason))
        self.client.publish(done_channel(self.prefix), self.job_id)
        return entry_id

    def run(self, tokens: list[tuple[int, str]], finish_reason: str = "length") -> None:
        """The whole job: running, each token, done."""
        self.start()
        for index, (token, text) in enumerate(tokens):
            self.token(index, token, text)
        self.finish(tokens, finish_reason)
