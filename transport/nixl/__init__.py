"""The NIXL data transport for peer links.

``agent`` wraps the NIXL agent (``NixlTransport``), ``host`` is the child process that runs it,
``hosted`` the daemon's side of that process (``HostedTransport``), and ``host_wire`` the pipe
between the two.
"""
