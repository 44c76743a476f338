"""sglang plugin: hooks on sglang's Mooncake send path and page conversion, and its wire frames.

Imports nothing from sglang at package import; `plugin.register` (the
`sglang.srt.plugins` entry point) loads the hooks.
"""
