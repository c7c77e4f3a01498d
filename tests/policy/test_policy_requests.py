"""What a `methods:`/`paths:` rule admits of one HTTP request (`Rule.allows_request`, issues 38 and
40): methods as sent (case-sensitive), paths as whole-glob matches judged the way the strictest
server would read them, no body where a server may leave it unread, no method or URL override
header. The real requests through the name check are in tests/net and tests/vm."""

from __future__ import annotations

import pytest

from policy import load_policy
from policy.model import HTTP_METHODS, OVERRIDE_HEADERS, Rule, form_type, path_ambiguity, query_overrides

RULES = """\
version: 1
allow:
  - host: pypi.test
    ports: [443]
    methods: [GET, HEAD]
  - host: files.test
    ports: [443]
    paths: ["/upload", "/simple/*/json"]
  - host: index.test
    ports: [443]
    methods: [GET, POST]
    paths: ["/simple/*"]
  - host: open.test
    ports: [443]
"""


def rule(host: str) -> Rule:
    (found,) = load_policy(RULES, "p.yml").rules_for_host(host)
    return found


def test_methods_are_compared_as_sent_so_odd_case_is_refused() -> None:
    methods = rule("pypi.test")
    assert methods.allows_request("GET", "/") and methods.allows_request("HEAD", "/")
    for odd in ("GeT", "hEAD", "get", "Head"):
        assert not methods.allows_request(odd, "/"), odd


def test_paths_match_a_whole_glob_never_a_prefix() -> None:
    paths = rule("files.test")
    assert paths.allows_request("PUT", "/upload") and paths.allows_request("GET", "/simple/a/json")
    for path in ("/upload2", "/upload/x", "/uploadx", "/simple/a/json-x", "/simple/a/json/", "/"):
        assert not paths.allows_request("GET", path), path


@pytest.mark.parametrize("path", [
    "/simple/..;/upload/x",  # Tomcat, Jetty and Spring drop ";..." before resolving "..": /upload/x
    "/simple/x/..;jsessionid=1/..;/upload/x",
    "/simple/x;a=b",  # any ; parameter, even one that walks nowhere
    "/simple/x%3b/",  # ... and its escape
    "/simple/x%ef%bc%9bjsessionid=1", "/simple/x%cd%be/y",  # fullwidth ; and the Greek question mark: ; in NFKC
    "/simple/../upload", "/simple/./x", "/simple/x/..", "/simple/.../x", "/simple/..x/y",
    "/simple/..%20/x", "/simple/%20/x",  # Windows trims trailing dots and spaces: ".. " is ".."
    "/simple//x", "/simple/x\\..\\..\\upload", "/simple/x#/../../upload",
    "/simple/%2e%2e/upload", "/simple/%2E/x", "/simple/x%2fy", "/simple/x%5cy", "/simple/%252e%252e/upload",
    "/simple/x%00/json", "/simple/x%3f/y", "/simple/x%23/y", "/simple/%zz", "/simple/%",
    "/simple/%c0%ae%c0%ae/upload",  # an overlong UTF-8 dot
    "/simple/%ef%bc%8e%ef%bc%8e%ef%bc%8fupload",  # fullwidth "../": NFKC makes it ../
    "*", "simple/x",
])
def test_a_path_a_server_could_read_another_way_is_refused(path: str) -> None:
    index = rule("index.test")
    assert path_ambiguity(path) is not None, path
    assert not index.allows_request("GET", path), path


@pytest.mark.parametrize("path", ["/simple/", "/simple/demo-pkg/", "/simple/a.b/c-1.0.tar.gz", "/simple/%C3%A9t%C3%A9/",
                                  "/simple/.well-known/x", "/simple/a~b/x+y=z/@v:1/"])
def test_plain_paths_still_pass(path: str) -> None:
    assert path_ambiguity(path) is None, path
    assert rule("index.test").allows_request("GET", path), path


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "TRACE", "DELETE", "GeT", "FOO"])
def test_a_body_is_refused_on_a_method_a_server_may_leave_it_unread_on(method: str) -> None:
    paths_only = rule("files.test")
    assert paths_only.allows_request(method, "/upload")
    assert not paths_only.allows_request(method, "/upload", body=True)


def test_a_body_passes_where_every_server_reads_it_and_where_no_request_rule_applies() -> None:
    assert rule("files.test").allows_request("POST", "/upload", body=True)
    assert rule("index.test").allows_request("POST", "/simple/x", body=True)
    assert rule("open.test").allows_request("GET", "/anything;x", body=True, overrides=("x-http-method",))


@pytest.mark.parametrize("header", sorted(OVERRIDE_HEADERS))
def test_override_headers_are_refused_under_methods_and_paths(header: str) -> None:
    for host in ("pypi.test", "files.test", "index.test"):
        assert not rule(host).allows_request("GET", "/simple/x/json", overrides=(header,)), (host, header)
    assert rule("index.test").allows_request("GET", "/simple/x/json")


@pytest.mark.parametrize("query", ["_method=DELETE", "_METHOD=put", "%5Fmethod=DELETE", "%255Fmethod=DELETE",
                                   ".method=DELETE", "[method=DELETE", "_method[]=DELETE", "_method[x]=1",
                                   "a=1;_method=DELETE", "a=1&_method", "_method%00=DELETE",
                                   "x_http_method_override=DELETE", "X-Original-URL=/upload"])
def test_query_parameters_frameworks_read_as_the_method_are_found_in_any_spelling(query: str) -> None:
    found = query_overrides(query)
    assert found and all(key.startswith("?") for key in found), query
    for host in ("pypi.test", "files.test", "index.test"):  # refused like the override headers
        assert not rule(host).allows_request("POST", "/simple/x/json", overrides=found), (host, query)
    assert rule("open.test").allows_request("POST", "/", overrides=found)


@pytest.mark.parametrize("query", ["", "a=1&b=2", "method=flickr.photos.search", "+method=x", "q=_method",
                                   "methods=1", "_methodical=1"])
def test_other_query_parameters_are_no_override(query: str) -> None:
    assert query_overrides(query) == ()


@pytest.mark.parametrize(("types", "form"), [
    ((), True), (("",), True), (("text/plain", "text/plain"), True),
    (("application/x-www-form-urlencoded",), True), (("Application/X-WWW-Form-Urlencoded; charset=ibm037",), True),
    (("multipart/form-data; boundary=x",), True), (("multipart/mixed; boundary=x",), True),
    (("application/json",), True), (("application/vnd.api+json",), True), (("text/plain; x=/json",), True),
    (("application/octet-stream",), False), (("text/plain",), False), (("application/gzip",), False),
])
def test_which_bodies_a_framework_could_read_as_form_fields(types: tuple[str, ...], form: bool) -> None:
    assert form_type(types) is form


def test_a_form_body_passes_only_a_rule_that_admits_every_method_a_method_field_could_name() -> None:
    # index.test: methods [GET, POST]: a `_method` field could make the POST a DELETE
    assert not rule("index.test").allows_request("POST", "/simple/x", body=True, form=True)
    assert rule("index.test").allows_request("POST", "/simple/x", body=True)  # an octet-stream, say
    assert rule("index.test").allows_request("POST", "/simple/x", form=True)  # no body, no field
    assert rule("files.test").allows_request("POST", "/upload", body=True, form=True)  # paths only: any method
    every = Rule(frozenset({443}), host="all.test", methods=frozenset(HTTP_METHODS) - {"HEAD"})
    assert every.allows_request("POST", "/", body=True, form=True)
    short = Rule(frozenset({443}), host="all.test", methods=frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"}))
    assert not short.allows_request("POST", "/", body=True, form=True)  # Symfony would take _method=OPTIONS
