"""Reading graphs: module names, attention forms, sensitive-layer analysis, FX helpers, and the
one module that touches Python frames and Dynamo internals. Nothing here rewrites a graph
(that is fx_fp8.passes)."""
