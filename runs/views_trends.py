"""Placeholder, replaced below."""


def trends_page(request):  # pragma: no cover
    raise NotImplementedError
