from django.contrib import admin
from django.http import JsonResponse
from django.urls import path


def health(request):
    """The one anonymous route: load balancers probe it."""
    return JsonResponse({"status": "ok"})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("health", health),
]
