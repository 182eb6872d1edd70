"""How every txlserve process writes its log: one format for its own lines, uvicorn's and the libraries'."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REQUESTS = "txlserve.requests"  # its lines' messages are JSON objects: a json log takes their fields as its own


class JsonFormatter(logging.Formatter):
    """One JSON object a line (``--log-format json``), for a log collector: ``time`` (UTC, ISO 8601),
    ``level``, ``logger``, ``message``, ``worker`` where there are workers, a traceback's text as ``exc_info``,
    and a request line's fields (request_id, route, status...) at the top level rather than as a string."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name}
        if self.worker is not None:
            out["worker"] = self.worker
        message = record.getMessage()
        fields = _object(message) if record.name == REQUESTS else None
        out.update(fields if fields is not None else {"message": message})
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            out["exc_info"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def _object(text: str) -> dict[str, object] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def configure(level: str, fmt: str = "text", worker: int | None = None) -> None:
    """The root logger's one handler (stderr), in ``fmt``; uvicorn's loggers write through it too (the server
    gives uvicorn no log config of its own), so that its lines carry a time and, as json, the same shape."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        prefix = "" if worker is None else f" [worker {worker}]"
        handler.setFormatter(logging.Formatter(TEXT.replace("%(name)s:", f"%(name)s{prefix}:")))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
