"""A small kopf operator for the conformance suite: records each handler call as a JSON line in $LK_KOPF_LOG."""

import json
import os

import kopf


def _record(kind: str, body) -> None:
    with open(os.environ["LK_KOPF_LOG"], "a") as log:
        log.write(
            json.dumps(
                {"handler": kind, "name": body["metadata"]["name"], "generation": body["metadata"].get("generation")}
            )
            + "\n"
        )


@kopf.on.login()
def login(**_):
    return kopf.ConnectionInfo(server=os.environ["LK_KOPF_SERVER"], token="localkube", default_namespace="default")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.watching.server_timeout = 10
    settings.watching.client_timeout = 15
    settings.posting.level = 20  # INFO and above become Events
    settings.posting.loggers = True  # handler log lines too (off by default in kopf 1.45)


@kopf.on.create("example.com", "v1", "widgets")
def on_create(body, patch, logger, **_):
    _record("create", body)
    logger.info("widget arrived")
    kopf.event(body, type="Normal", reason="Provisioned", message="provisioned by the test operator")
    patch.status["phase"] = "Created"
    return {"size": body["spec"]["size"]}


@kopf.on.update("example.com", "v1", "widgets")
def on_update(body, patch, **_):
    _record("update", body)
    patch.status["phase"] = "Updated"


@kopf.on.delete("example.com", "v1", "widgets")
def on_delete(body, **_):
    _record("delete", body)
