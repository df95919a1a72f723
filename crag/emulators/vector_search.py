"""Databricks Vector Search, emulated: describe, create and sync an index (recorded), and similarity
search over the emulator's knowledge-base index with BM25."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from crag.backends.bm25 import load_index

if TYPE_CHECKING:
    from crag.emulators.server import Emulator


def vector_search(emulator: Emulator, method: str, path: str, body: Any, fault: str):
    parts = path.strip("/").split("/")  # api 2.0 vector-search ...
    known = emulator.vector_indexes
    if parts[3] == "endpoints" and len(parts) == 7 and method == "GET":
        ep, idx = parts[4], parts[6]
        if known is not None and idx not in known:
            return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": f"Index {idx} does not exist"}
        return 200, {
            "name": idx,
            "endpoint_name": ep,
            "index_type": "DELTA_SYNC",
            "primary_key": "chunk_id",
            "status": {"ready": True, "detailed_state": "ONLINE_NO_PENDING_UPDATE", "indexed_row_count": 0},
        }
    if parts[3] == "endpoints" and parts[-1] == "indexes" and method == "POST":  # create a Delta Sync index
        name = body.get("name")
        if known is not None:
            if name in known:
                return 409, {"error_code": "RESOURCE_ALREADY_EXISTS", "message": f"Index {name} already exists"}
            known[name] = body
        return 200, {**body, "endpoint_name": parts[4], "status": {"ready": False, "detailed_state": "PROVISIONING"}}
    if parts[3] == "indexes" and parts[-1] == "sync":
        if known is not None and parts[4] not in known:
            return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": f"Index {parts[4]} does not exist"}
        emulator.syncs.append(parts[4])
        return 200, {}
    if parts[3] == "indexes" and parts[-1] == "query":
        if not emulator.kb_index:
            return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no index loaded"}

        columns = body.get("columns") or []
        index = load_index(emulator.kb_index)
        rows = index.search_chunks(body.get("query_text") or "", int(body.get("num_results") or 5))
        data = [[row.get(c) for c in columns] + [score] for row, score in rows]
        return 200, {
            "manifest": {
                "column_count": len(columns) + 1,
                "columns": [{"name": c} for c in columns] + [{"name": "score"}],
            },
            "result": {"row_count": len(data), "data_array": data},
        }
    return 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": path}
