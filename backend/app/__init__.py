"""The application on top of the library: the ``journeyman`` command line, the demo, and the
HTTP server behind ``journeyman serve``. Only this folder imports both ``journeyman.integrations``
and ``journeyman.backend``; the library packages below it never import each other."""
