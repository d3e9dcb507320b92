from django.contrib import admin
from django.http import JsonResponse
from django.urls import path

from controlplane.api import api


def health(request):
    """The one anonymous route: load balancers probe it."""
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("health", health),
    path("api/", api.urls),
]
