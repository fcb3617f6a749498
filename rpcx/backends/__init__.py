"""Built-in transports. Each module is one transport and its registration hook."""
