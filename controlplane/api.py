"""Stand-alone Stepguard's part of the API: a body limit in front of /api/. The API itself is
the runs app's (runs/rest.py), mounted by runs.urls."""

from django.conf import settings

from runs.rest import error


class BodyLimitMiddleware:
    """Refuse an oversized API body before anything reads it (Content-Length), with the error
    shape of the API. Bodies without a length are cut off by DATA_UPLOAD_MAX_MEMORY_SIZE."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith("/api/"):
            try:
                length = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                return error(400, "bad_request", "Content-Length is not a number")
            if length > settings.STEPGUARD_API_MAX_BODY:
                limit = settings.STEPGUARD_API_MAX_BODY
                return error(413, "payload_too_large", f"request body over the {limit}-byte limit")
        return self.get_response(request)
