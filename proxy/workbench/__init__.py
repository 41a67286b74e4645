"""The agent workbench: three local assistants on LangGraph that use the proxy like any app.

It talks to the proxy only over HTTP (the OpenAI URL, the ``X-Radix-*`` answer headers,
``/health`` and ``/metrics``). ``data`` and ``scenarios`` need nothing beyond the proxy's
own dependencies; ``graph`` (and so ``app``) need the ``workbench`` extra (LangGraph).
"""
