"""The redaction filter on its own: every shape in which botocore and urllib3 log a credential."""

from __future__ import annotations

import pytest

from gpusnap.storage.redact import redact
from tests.security.test_no_secrets_in_logs import SECRET_KEY, SESSION_TOKEN, assert_clean


@pytest.mark.parametrize(
    "line",
    [
        "headers={'X-Amz-Security-Token': b'" + SESSION_TOKEN + "', 'Authorization': b'AWS4-HMAC"
        "-SHA256 Credential=AKIA/20261201/us-east-1/s3/aws4_request, SignedHeaders=host, "
        "Signature=0123abcd'}",
        "x-amz-security-token:" + SESSION_TOKEN + "\nhost:127.0.0.1",
        "aws_secret_access_key = " + SECRET_KEY,
        "GET /b/k?X-Amz-Security-Token=" + SESSION_TOKEN + "&X-Amz-Signature=ff HTTP/1.1",
        "{'SecretAccessKey': '" + SECRET_KEY + "', 'SessionToken': '" + SESSION_TOKEN + "'}",
    ],
)
def test_every_shape_of_credential_botocore_logs_is_redacted(line: str) -> None:
    cleaned = redact(line)
    assert_clean(cleaned)
    assert "0123abcd" not in cleaned and "AKIA/2026" not in cleaned
