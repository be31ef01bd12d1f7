"""The gateway's HTTP API, as module-level ASGI endpoints and Starlette route handlers: the turn
endpoints (:mod:`.turn`), the other routes (:mod:`.routes`), the authentication middleware
(:mod:`.authenticate`) and the errors they answer (:mod:`.error_responses`). The app that puts
them together is :func:`kvturn.gateway.app.create_app`; each handler finds its
:class:`~kvturn.gateway.instance.Gateway` in the app's state."""
