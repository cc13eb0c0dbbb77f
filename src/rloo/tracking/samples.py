"""Sample-generation tables as standalone HTML and JSON files (artifacts a browser or a script can read)."""

from __future__ import annotations

import html
import json
import math
from typing import Any

COLUMNS = ("query", "response", "score")


def _score(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def samples_json(step: int, rows: list[dict[str, Any]]) -> str:
    """``{"update": step, "columns": [...], "rows": [{query, response, score, ...extra}, ...]}``."""
    out_rows = []
    for row in rows:
        rec = {k: row.get(k) for k in COLUMNS}
        rec["score"] = _score(row.get("score"))
        rec.update(
            {k: v for k, v in row.items() if k not in COLUMNS and isinstance(v, (str, int, float, bool))}
        )
        out_rows.append(rec)
    return json.dumps(
        {"update": step, "columns": list(COLUMNS), "rows": out_rows}, indent=1, ensure_ascii=False
    )


def samples_html(step: int, rows: list[dict[str, Any]]) -> str:
    """A self-contained HTML page (no scripts, everything escaped)."""
    body = []
    for row in rows:
        score = _score(row.get("score"))
        body.append(
            "<tr><td>{}</td><td>{}</td><td class=num>{}</td></tr>".format(
                html.escape(str(row.get("query", ""))),
                html.escape(str(row.get("response", ""))),
                "None" if score is None else f"{score:.4f}",
            )
        )
    return (
        "<!doctype html><html><head><meta charset=utf-8>"
        f"<title>sample generations at update {step}</title>"
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;white-space:pre-wrap}"
        ".num{text-align:right}</style></head><body>"
        f"<h2>sample generations at update {step}</h2>"
        "<table><thead><tr><th>query</th><th>model response</th><th>score</th></tr></thead><tbody>"
        + "".join(body)
        + "</tbody></table></body></html>\n"
    )
