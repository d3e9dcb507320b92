from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.contrib.auth.views import LoginView
from django.urls import include, path

from controlplane.metrics import metrics
from runs.health import health

urlpatterns = [
    path("", include("runs.urls")),
    path("login/", LoginView.as_view(template_name="stepguard/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("health", health),
    path("metrics", metrics),
]
