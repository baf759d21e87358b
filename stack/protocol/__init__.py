"""The request contract: what an engine receives on /v1/chat/completions and /v1/completions.

One set of frozen types (`types`), one table of limits (`bounds`), one parser (`parse`), one check
of what a backend can do (`capabilities`) and one serialiser (`serialise`), used by the router
(after translating its APIs into a chat or completion request) and by the engine alike, so both
sides give the same verdict on the same body.
"""
