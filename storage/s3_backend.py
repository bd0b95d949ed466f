"""The ``s3://bucket/prefix`` backend: objects in an S3 (or S3-compatible) bucket via boto3.

Key ``a/b`` lives at ``prefix/a/b``. Credentials come from boto3's standard chain
(environment, profile, instance or container role). botocore's own retries are turned off
(one attempt per call): ``RetryingBackend`` is the single place that retries, so the number
of attempts and the backoff are what the operator configured, not their product.

Writes: below ``multipart_threshold`` a single PutObject; at or above it a real multipart
upload (aborted on any failure, so no stray parts are billed). ``if_absent`` sends
``If-None-Match: *`` on PutObject and on CompleteMultipartUpload: a 412 becomes
``AlreadyExists``, a 409 ``ConditionalRequestConflict`` (a concurrent writer is mid-flight)
becomes ``Unavailable``, so the retry re-uploads and then gets a definite answer.

With a custom ``endpoint_url`` (MinIO, R2, GCS interop, moto), request checksums are only
sent where the API requires them: several S3-compatible stores reject the CRC headers that
botocore >= 1.36 adds by default. Data integrity does not depend on them: every chunk is
verified against its content hash on read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote, urlsplit

import boto3
import botocore.exceptions
from botocore.config import Config

from gpusnap.errors import (
    FailedPrecondition,
    GpusnapError,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from gpusnap.storage.backend import BackendOptions, ObjectInfo, check_range, key_taken, no_object
from gpusnap.storage.layout import is_valid_key, validate_key, validate_prefix

log = logging.getLogger(__name__)

MIN_PART_SIZE = 5 * 1024 * 1024  # S3's floor for every part but the last
MAX_PARTS = 10_000

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_DENIED_CODES = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
    "AccountProblem",
    "InvalidObjectState",
}
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "ConditionalRequestConflict",
    "OperationAborted",
    "NoSuchUpload",  # our multipart upload vanished (lifecycle rule): redo the whole put
    "BadDigest",  # the body was damaged on the way: send it again
    "IncompleteBody",
}

_NO_CREDENTIALS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
)
_TRANSPORT_ERRORS = (
    botocore.exceptions.ConnectionError,  # refused, DNS, connect timeout
    botocore.exceptions.HTTPClientError,  # closed mid-request, read timeout, broken stream
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.CredentialRetrievalError,  # instance metadata briefly unreachable
    OSError,
)


class S3Backend:
    """A store in an S3 bucket. Use ``open_backend("s3://bucket/prefix")`` rather than this."""

    def __init__(self, bucket: str, prefix: str, options: BackendOptions) -> None:
        if not _BUCKET_RE.fullmatch(bucket):
            raise InvalidArgument(f"invalid S3 bucket name {bucket!r}")
        if prefix:
            validate_prefix(prefix)
        if options.multipart_chunksize < MIN_PART_SIZE:
            raise InvalidArgument(
                f"multipart_chunksize {options.multipart_chunksize} is below S3's "
                f"minimum part size of {MIN_PART_SIZE} bytes"
            )
        if options.multipart_threshold < 1:
            raise InvalidArgument("multipart_threshold must be positive")
        if options.addressing_style not in (None, "path", "virtual", "auto"):
            raise InvalidArgument(
                f"addressing_style {options.addressing_style!r} is not path, virtual or auto"
            )
        if options.sse not in (None, "AES256", "aws:kms"):
            raise InvalidArgument(f"sse {options.sse!r} is not AES256 or aws:kms")
        if options.sse_kms_key_id and options.sse != "aws:kms":
            raise InvalidArgument("sse_kms_key_id needs sse='aws:kms'")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.options = options
        self._sse: dict[str, str] = {}
        if options.sse:
            self._sse["ServerSideEncryption"] = options.sse
        if options.sse_kms_key_id:
            self._sse["SSEKMSKeyId"] = options.sse_kms_key_id
        self._client = _make_client(options)

    # -- the Backend protocol -------------------------------------------------------------

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        name = self._name(key)
        conditional = {"IfNoneMatch": "*"} if if_absent else {}
        if len(data) < self.options.multipart_threshold:
            try:
                self._client.put_object(
                    Bucket=self.bucket, Key=name, Body=data, **conditional, **self._sse
                )
            except Exception as exc:
                raise self._translate(exc, "put", key) from exc
            return
        self._put_multipart(key, name, data, conditional)

    def get(self, key: str, *, offset: int = 0, length: int | None = None) -> bytes:
        check_range(key, offset, length)
        name = self._name(key)
        if length == 0:
            # "bytes=N-(N-1)" is not a valid range; S3 would ignore it and send everything.
            if self.stat(key) is None:
                raise no_object(self.url, key)
            return b""
        extra: dict[str, str] = {}
        if offset or length is not None:
            last = "" if length is None else str(offset + length - 1)
            extra["Range"] = f"bytes={offset}-{last}"
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=name, **extra)
            body = response["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
        except Exception as exc:
            if _error_code(exc) == "InvalidRange":
                return b""  # offset at or past the end of an existing object
            raise self._translate(exc, "get", key) from exc
        return data

    def stat(self, key: str) -> ObjectInfo | None:
        name = self._name(key)
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=name)
        except Exception as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                return None
            raise self._translate(exc, "stat", key) from exc
        return ObjectInfo(
            key=key, size=int(head["ContentLength"]), mtime=head["LastModified"].timestamp()
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                for obj in page.get("Contents", ()):
                    key = str(obj["Key"])
                    # Anyone with write access to the bucket may plant "p/manifests/../x" or
                    # a name with a newline: skip what no key of ours can be, rather than
                    # letting one such object make every later get/delete fail.
                    if not key.startswith(base) or not is_valid_key(key[len(base) :]):
                        log.warning("%s: ignoring object %r, not a valid store key", self.url, key)
                        continue
                    yield ObjectInfo(
                        key=key[len(base) :],
                        size=int(obj["Size"]),
                        mtime=obj["LastModified"].timestamp(),
                    )
        except Exception as exc:
            raise self._translate(exc, "list", prefix) from exc

    def delete(self, key: str) -> None:
        name = self._name(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=name)
        except Exception as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                return
            raise self._translate(exc, "delete", key) from exc

    def close(self) -> None:
        self._client.close()

    # -- internals ------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _part_size(self, total: int) -> int:
        size = self.options.multipart_chunksize
        if -(-total // size) > MAX_PARTS:
            size = -(-total // MAX_PARTS)
        return size

    def _put_multipart(self, key: str, name: str, data: bytes, conditional: dict[str, str]) -> None:
        try:
            created = self._client.create_multipart_upload(
                Bucket=self.bucket, Key=name, **self._sse
            )
        except Exception as exc:
            raise self._translate(exc, "put", key) from exc
        upload_id: str = created["UploadId"]
        try:
            size = self._part_size(len(data))
            parts: list[dict[str, Any]] = []
            view = memoryview(data)
            for number, start in enumerate(range(0, len(data), size), start=1):
                response = self._client.upload_part(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=bytes(view[start : start + size]),
                )
                parts.append({"PartNumber": number, "ETag": response["ETag"]})
            self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=name,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **conditional,
            )
        except BaseException as exc:
            self._abort_quietly(name, upload_id)
            if isinstance(exc, Exception):
                raise self._translate(exc, "put", key) from exc
            raise
        log.debug("put %s: multipart upload of %d bytes in %d parts", key, len(data), len(parts))

    def _abort_quietly(self, name: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload_id)
        except Exception as exc:
            # A bucket lifecycle rule for incomplete uploads is the backstop.
            log.warning("could not abort multipart upload of %s: %s", name, _one_line(exc))

    def _translate(self, exc: Exception, op: str, key: str) -> GpusnapError:
        """Map a boto3/botocore failure to one of our error kinds, as one line."""
        if isinstance(exc, GpusnapError):
            return exc
        where = f"{self.url}: {op} {key!r}"
        if isinstance(exc, botocore.exceptions.ClientError):
            code = _error_code(exc)
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            message = exc.response.get("Error", {}).get("Message") or code
            if code == "NoSuchBucket":
                return NotFound(f"{where}: bucket {self.bucket!r} does not exist")
            if code in _NOT_FOUND_CODES:
                return no_object(self.url, key)
            if code == "PreconditionFailed" or status == 412:
                return key_taken(self.url, key)
            if code in _DENIED_CODES or status == 403:
                return FailedPrecondition(
                    f"{where}: access denied to bucket {self.bucket!r} ({code}: {message})"
                )
            if code in _TRANSIENT_CODES or status == 429 or status >= 500:
                return Unavailable(f"{where}: S3 answered {status} {code}: {message}")
            return Internal(f"{where}: S3 answered {status} {code}: {message}")
        if isinstance(exc, _NO_CREDENTIALS):
            return FailedPrecondition(
                f"{where}: no usable AWS credentials ({_one_line(exc)}); set them in the "
                "environment, a profile, or an instance role"
            )
        if isinstance(exc, botocore.exceptions.ProfileNotFound):
            return InvalidArgument(f"{where}: {_one_line(exc)}")
        if isinstance(exc, _TRANSPORT_ERRORS):
            return Unavailable(f"{where}: cannot reach S3: {_one_line(exc)}")
        return Internal(f"{where}: {type(exc).__name__}: {_one_line(exc)}")


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _make_client(options: BackendOptions) -> Any:
    config_kwargs: dict[str, Any] = {
        "retries": {"total_max_attempts": 1, "mode": "standard"},
        "max_pool_connections": options.max_pool_connections,
        "connect_timeout": options.connect_timeout,
        "read_timeout": options.read_timeout,
        "s3": {"addressing_style": options.addressing_style or "auto"},
    }
    if options.region:
        config_kwargs["region_name"] = options.region
    if options.endpoint_url:
        config_kwargs["request_checksum_calculation"] = "when_required"
        config_kwargs["response_checksum_validation"] = "when_required"
    try:
        session = boto3.session.Session(profile_name=options.profile, region_name=options.region)
        config = Config(**config_kwargs)
        return session.client("s3", endpoint_url=options.endpoint_url, config=config)
    except botocore.exceptions.ProfileNotFound as exc:
        raise InvalidArgument(f"AWS profile {options.profile!r} not found") from exc
    except (ValueError, botocore.exceptions.BotoCoreError) as exc:
        raise InvalidArgument(f"cannot configure the S3 client: {_one_line(exc)}") from exc


def open_s3_backend(url: str, options: BackendOptions) -> S3Backend:
    """Factory for ``s3://bucket`` and ``s3://bucket/prefix``."""
    parts = urlsplit(url)
    if not parts.netloc:
        raise InvalidArgument(f"store URL {url!r} names no bucket; expected s3://bucket/prefix")
    if "@" in parts.netloc or ":" in parts.netloc:
        raise InvalidArgument(
            f"store URL {url!r}: put no credentials or port in the URL; use the AWS credential "
            "chain and the endpoint URL option"
        )
    # "s3://bucket//x" or "s3://bucket/a/../b" would name keys no other tool agrees on.
    prefix = unquote(parts.path).removeprefix("/").removesuffix("/")
    if prefix and any(seg in ("", ".", "..") for seg in prefix.split("/")):
        raise InvalidArgument(
            f"store URL {url!r} has an invalid prefix: an empty, '.' or '..' segment"
        )
    return S3Backend(parts.netloc, prefix, options)
