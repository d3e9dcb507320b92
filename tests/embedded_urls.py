"""A host project's URLconf, for tests/test_embedding.py: Stepguard mounted at agents/ next to
the host's own pages, one of them named "runs" as Stepguard's runs list is."""

from django.http import HttpResponse
from django.urls import include, path


def host_runs(request):
    return HttpResponse("the host's own runs")


urlpatterns = [
    path("runs/", host_runs, name="runs"),
    path("accounts/", include("django.contrib.auth.urls")),
    path("agents/", include("runs.urls")),
]
