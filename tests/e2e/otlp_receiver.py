"""A small OTLP/HTTP trace receiver for the e2e tests: run with the vLLM python (it has OpenTelemetry's
protobuf classes), it takes ``POST /v1/traces`` (``application/x-protobuf``) and writes one JSON line per
span to a file: trace and span ids (hex), the parent's, the name, the service, the span's attributes and
whether its status is an error.

    python tests/e2e/otlp_receiver.py PORT OUT_FILE
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(value: Any) -> Any:
    """An attribute's value as JSON: its string, int, float or bool, whichever it holds."""
    kind = value.WhichOneof("value")
    scalar = kind in ("string_value", "int_value", "double_value", "bool_value")
    return getattr(value, kind) if scalar else None


def main() -> None:
    port, out = int(sys.argv[1]), sys.argv[2]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            with open(out, "a") as sink:
                for resource_spans in request.resource_spans:
                    attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            line = {
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "name": span.name,
                                "service": attributes.get("service.name", ""),
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                                "error": span.status.code == span.status.STATUS_CODE_ERROR,
                            }
                            sink.write(json.dumps(line) + "\n")
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
