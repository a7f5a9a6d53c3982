"""EC2 instance metadata (IMDSv2): the instance type when config and environment do not say. Absent IMDS is normal."""

from __future__ import annotations

import logging
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_S = 21600


class Imds:
    def __init__(self, endpoint: str = "http://169.254.169.254", timeout_s: float = 0.5):
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self._token: str | None = None
        # Never route metadata requests through an HTTP proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _fetch_token(self) -> str:
        req = urllib.request.Request(self.endpoint + TOKEN_PATH, method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        with self._opener.open(req, timeout=self.timeout_s) as resp:
            return resp.read().decode().strip()

    def get(self, path: str) -> str | None:
        """The metadata value at `path` (e.g. `meta-data/instance-type`), or None when IMDS is not there."""
        try:
            if self._token is None:
                self._token = self._fetch_token()
            req = urllib.request.Request(f"{self.endpoint}/latest/{path.lstrip('/')}",
                                         headers={"X-aws-ec2-metadata-token": self._token})
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return resp.read().decode().strip()
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                self._token = None  # expired token: the next call fetches a new one
            log.debug("IMDS %s: HTTP %s", path, exc.code)
            return None
        except (OSError, ValueError) as exc:
            log.debug("IMDS not reachable at %s: %s", self.endpoint, exc)
            return None

    def instance_type(self) -> str | None:
        return self.get("meta-data/instance-type")


def resolve_instance_type(configured: str | None, imds: Imds | None) -> str | None:
    """Config or environment (already folded into `configured`) first, then IMDS."""
    if configured:
        return configured
    if imds is None:
        return None
    return imds.instance_type()
