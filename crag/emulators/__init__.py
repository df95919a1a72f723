"""Loopback emulators of the production services, speaking their REST protocols exactly, so that the
real client libraries (mlflow deployments, openai, databricks-vectorsearch, tavily-python) can be
pointed at them: by the tests, by the benchmarks, and by `crag emulate` for trying a production config
on a laptop.

One server answers all of them:
    GET  /.well-known/databricks-config                     host metadata (the Databricks SDK asks first)
    POST /serving-endpoints/{name}/invocations              chat completions, or the batch shape
                                                            {"inputs": [{"prompt"}], "params"} -> {"predictions"}
    POST /serving-endpoints/chat/completions, /v1/chat/completions   OpenAI-compatible chat
    GET  /api/2.0/vector-search/endpoints/{ep}/indexes/{idx}          describe an index
    GET|POST /api/2.0/vector-search/indexes/{idx}/query               similarity search
    GET  /api/2.0/serving-endpoints/{name}                  describe a serving endpoint
    POST /api/2.0/vector-search/endpoints/{ep}/indexes, .../sync      create / sync (recorded)
    POST /search                                            Tavily

server.py runs it; serving.py, vector_search.py and tavily.py each answer one service.
"""

from crag.emulators.server import FAULTS, SERVICES, Emulator, Recorded, ServiceBehaviour, endpoint_of

__all__ = ["FAULTS", "SERVICES", "Emulator", "Recorded", "ServiceBehaviour", "endpoint_of"]
