"""Scalable-topic admin routes (PIP-468, DESIGN.md §3.3): the place they plug in.

To come in the scalable-topics issue, each as a :class:`~anabranch.admin.routes.Route`
appended to ``ROUTES`` (the HTTP app and the OpenAPI document pick them up unchanged):

* ``/admin/v2/scalable/{tenant}/{namespace}`` GET list;
  ``/{topic}`` PUT ``?numInitialSegments=N``, GET metadata, DELETE; ``/{topic}/stats``;
  ``/{topic}/subscriptions/{sub}`` PUT/DELETE; ``POST /{topic}/split/{segmentId}``;
  ``POST /{topic}/merge/{id1}/{id2}``.
* ``/admin/v2/segments/{tenant}/{namespace}/{topic}/{descriptor}`` PUT (JSON list of
  subscriptions), ``POST .../terminate``, DELETE.
* A non-leader answers a mutation with 307 to the controller leader: raise a redirect
  error from the service layer and let ``http.py``'s error middleware map it.

Example:
    >>> ROUTES
    []
"""

from __future__ import annotations

from anabranch.admin.routes import Route

ROUTES: list[Route] = []
