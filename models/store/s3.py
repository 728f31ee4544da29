"""S3, or any S3-compatible server (MinIO, R2...), as the object store, through boto3: a single
PUT (or a multipart upload's last part) makes an object visible complete, and botocore's
errors become the store's own."""

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

from sdq.models.store.interface import (
    LARGE_PART,
    LARGE_PARTS_AT_ONCE,
    MissingBucket,
    MissingObject,
    StoreError,
    StoreUnavailable,
)


class S3Store:
    """Endpoint, region and credentials come from boto3's own settings (AWS_ENDPOINT_URL...)."""

    def __init__(self, bucket: str, prefix: str = "") -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")

    @classmethod
    def from_uri(cls, uri: str) -> "S3Store":
        """`s3://bucket/prefix`: the store rooted at that prefix."""
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise StoreError(f"not an s3://bucket/prefix URI: {uri!r}")
        return cls(parsed.netloc, parsed.path)

    @cached_property
    def _client(self):
        import boto3
        from botocore.config import Config

        # Standard retry mode already backs off on throttling and 5xx; more is the task's job.
        config = Config(retries={"mode": "standard", "max_attempts": 3}, max_pool_connections=32)
        return boto3.client("s3", config=config)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_bytes(self, key: str, data: bytes, *, content_type: str) -> str:
        with self._errors(key):
            self._client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, ContentType=content_type
            )
        return self.uri(key)

    def put_file(self, key: str, source: Path) -> str:
        # upload_file switches to multipart for large files; S3 shows the object only once
        # the last part is in, so a pipeline's weights are never visible half-uploaded.
        with self._errors(key):
            self._client.upload_file(str(source), self.bucket, self._key(key))
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        with self._errors(key):
            return self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def get_large(self, key: str) -> memoryview:
        """A large object in memory, fetched as ranged GETs of LARGE_PART bytes in parallel
        (boto3's managed download): one connection's speed no longer caps the read."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=LARGE_PART,
            multipart_chunksize=LARGE_PART,
            max_concurrency=LARGE_PARTS_AT_ONCE,
        )
        buffer = io.BytesIO()
        with self._errors(key):
            self._client.download_fileobj(self.bucket, self._key(key), buffer, Config=config)
        return buffer.getbuffer()

    def get_file(self, key: str, destination: Path) -> None:
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = destination.with_name(f".{destination.name}.part")
        with self._errors(key):
            self._client.download_file(self.bucket, self._key(key), str(partial))
        os.replace(partial, destination)

    def copy(self, source: str, key: str) -> str:
        # The server copies (a multipart copy past 5 GB, boto3's managed copy): no byte of
        # the object travels through this process.
        with self._errors(source):
            self._client.copy({"Bucket": self.bucket, "Key": self._key(source)}, self.bucket,
                              self._key(key))  # fmt: skip
        return self.uri(key)

    def exists(self, key: str) -> bool:
        try:
            with self._errors(key):
                self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except MissingObject:
            return False
        return True

    def delete(self, key: str) -> None:
        with self._errors(key):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def list_keys(self, prefix: str) -> Iterator[str]:
        yield from self.object_digests(prefix)

    def holds_any(self, prefix: str) -> bool:
        """Whether any object lies under the prefix: one listing call of one key."""
        with self._errors(prefix):
            page = self._client.list_objects_v2(
                Bucket=self.bucket, Prefix=self._key(prefix), MaxKeys=1
            )
        return page.get("KeyCount", 0) > 0

    def object_digests(self, prefix: str) -> dict[str, str]:
        """Key -> ETag for every object under the prefix: a content identity without a download."""
        strip = len(self._key(""))
        digests: dict[str, str] = {}
        with self._errors(prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            )
            for page in pages:
                for item in page.get("Contents", []):
                    digests[item["Key"][strip:]] = item["ETag"].strip('"')
        return digests

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def link(self, key: str, *, expires_seconds: int) -> str:
        """What a browser opens: a presigned HTTPS link, good for `expires_seconds`, so a
        private bucket's object can be shown without handing out credentials."""
        return self._client.generate_presigned_url(
            "get_object",
            Params={"Bucket": self.bucket, "Key": self._key(key)},
            ExpiresIn=expires_seconds,
        )

    def check(self) -> None:
        with self._errors(""):
            self._client.head_bucket(Bucket=self.bucket)

    def ensure(self) -> bool:
        """Makes the bucket, in the client's region, when it is missing; True when it did.
        Credentials that may not make buckets get the store's refusal, bucket named."""
        try:
            self.check()
            return False
        except MissingBucket:
            pass
        region = self._client.meta.region_name
        placed = {} if region in (None, "us-east-1") else {
            "CreateBucketConfiguration": {"LocationConstraint": region}
        }  # fmt: skip
        with self._errors(""):
            self._client.create_bucket(Bucket=self.bucket, **placed)
        return True

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Turns botocore's exceptions into the two sdq acts on, with a readable text."""
        from boto3.exceptions import RetriesExceededError, S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
        from s3transfer.exceptions import RetriesExceededError as PartRetriesExceededError

        where, endpoint = self.uri(key), self._client.meta.endpoint_url
        try:
            yield
        except ClientError as error:
            raise self._refusal(error, key) from error
        except S3UploadFailedError as error:
            # boto3 raises its own error for a file upload's client error, inside the handler
            # of that error: what the server said is its context.
            context = error.__context__
            if isinstance(context, ClientError):
                raise self._refusal(context, key) from error
            raise StoreUnavailable(f"{endpoint} failed on {where}: {error}") from error
        except NoCredentialsError as error:
            raise StoreError(f"no AWS credentials configured for {where}") from error
        except (BotoCoreError, RetriesExceededError, PartRetriesExceededError) as error:
            # Connection refused, timeouts, DNS (a managed transfer's after its own retries):
            # the endpoint may come back.
            raise StoreUnavailable(f"cannot reach {endpoint} for {where}: {error}") from error

    def _bucket_there(self) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as error:
            return _code(error) not in ("404", "NoSuchBucket")
        return True

    def _refusal(self, error, key: str) -> StoreError:
        """What an S3 error response means for sdq: a lasting problem, or an outage."""
        where, endpoint = self.uri(key), self._client.meta.endpoint_url
        code = _code(error)
        if code == "404" and key:
            # A HEAD (a download starts with one) answers a bare 404 for a missing bucket as
            # for a missing key: ask which.
            code = "NoSuchKey" if self._bucket_there() else "NoSuchBucket"
        if code == "NoSuchBucket" or (code == "404" and not key):
            return MissingBucket(
                f"bucket {self.bucket!r} does not exist at {endpoint}: `sdq db upgrade` makes "
                "it (or make it yourself where these credentials may not)"
            )
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
            return StoreError(f"{endpoint} rejected the credentials for {where}: {code}")
        if code in ("404", "NoSuchKey"):
            return MissingObject(f"no object {where}")
        if code.startswith("5") or code in ("SlowDown", "InternalError", "ServiceUnavailable"):
            return StoreUnavailable(f"{endpoint} failed on {where}: {code}")
        return StoreError(f"{endpoint} refused {where}: {code}")


def _code(error) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))
