"""The web viewer (``tensorkv view``): a read-only Starlette app over one store.

- ``server``: address checks (loopback only unless allowed), the listening socket, uvicorn;
- ``app``: :func:`create_app`, the JSON API under ``/api/`` and the static pages;
- ``api``: the endpoints, plain functions over the query layer (:mod:`tensorkv.viewer`);
- ``static/``: the pages (HTML, a small vanilla JS file) and the vendored uPlot
  (``static/vendor/VENDOR.md`` records its version and checksums).

Starlette and uvicorn are the ``view`` extra: ``pip install "tensorkv[view]"``.
"""
