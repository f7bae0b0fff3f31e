//! AWS Signature Version 4 for S3: signing a request with the `Authorization` header, pure.
//!
//! [`sign`] builds the pieces AWS describes for S3 requests whose payload travels in a single
//! chunk ("Signature Calculations for the Authorization Header: Transferring Payload in a Single
//! Chunk" in the Amazon S3 API Reference):
//!
//! 1. the canonical request ([`canonical_request`]): method, canonical URI (the path with each
//!    segment [URI-encoded](uri_encode), `/` kept; S3 neither normalises paths nor encodes them
//!    twice), canonical query string, canonical headers, signed header names and the payload
//!    hash (a hex SHA-256, or the literal `UNSIGNED-PAYLOAD`);
//! 2. the string to sign: `AWS4-HMAC-SHA256`, the request time, the scope
//!    `<date>/<region>/s3/aws4_request` and the hex SHA-256 of the canonical request;
//! 3. the signing key, an HMAC-SHA256 chain from `"AWS4" + secret` through the date, the
//!    region, `s3` and `aws4_request`, and the signature, the HMAC of the string to sign.
//!
//! It returns the `Authorization` header and the `x-amz-*` headers that were signed
//! ([`Signed`]); the caller sends them with the request. Temporary credentials are supported:
//! their session token is signed and sent as `x-amz-security-token`.
//!
//! Not implemented: chunked (streaming, `aws-chunked`) payload signing, trailing headers,
//! presigned URLs (query-string authentication), browser POST policies and SigV4A
//! (`AWS4-ECDSA-P256-SHA256`). The module reads no clock except in [`amz_date_now`] and does no
//! I/O.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use ring::{digest, hmac};

/// The algorithm name that opens the string to sign and the `Authorization` header.
const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// The service name in the credential scope.
const SERVICE: &str = "s3";
/// The terminator of the credential scope.
const TERMINATOR: &str = "aws4_request";
/// Seconds in a (UTC, leap-second-free) day.
const SECONDS_PER_DAY: u64 = 86_400;

/// Long-term or temporary AWS credentials. Debug shows the secret and the session token as
/// `"<redacted>"`.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The access key ID, e.g. `AKIAIOSFODNN7EXAMPLE`; it appears in the `Authorization` header.
    pub access_key_id: String,
    /// The secret access key; it only keys the HMAC chain and never leaves this module.
    pub secret_access_key: String,
    /// The session token of temporary credentials (STS), sent and signed as
    /// `x-amz-security-token`.
    pub session_token: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// A request to sign.
///
/// `headers` must not repeat the headers [`sign`] adds itself (`host`, `x-amz-date`,
/// `x-amz-content-sha256`, `x-amz-security-token`): a repeated name is signed as one header
/// whose values are joined with `,`, as SigV4 does for headers sent more than once.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The HTTP method, e.g. `"GET"`, `"PUT"`, `"DELETE"`, `"HEAD"`.
    pub method: &'a str,
    /// The `Host` header value exactly as sent (with `:port` when the port is not the scheme's
    /// default).
    pub host: &'a str,
    /// The raw (not yet encoded) absolute path, e.g. `"/bucket/a b/c:d"`. [`sign`] encodes each
    /// segment with [`uri_encode`], keeping `/`; an empty path is `/`.
    pub path: &'a str,
    /// Raw (unencoded) query parameters, in any order; may be empty. A parameter with an empty
    /// value is allowed (e.g. `("lifecycle", "")`) and is signed as `lifecycle=`.
    pub query: &'a [(&'a str, &'a str)],
    /// Extra headers to sign besides the ones [`sign`] adds, e.g. `("range", "bytes=0-9")`.
    /// Names may be given in any case; values are trimmed and inner runs of spaces collapsed.
    pub headers: &'a [(&'a str, &'a str)],
    /// The lowercase hex SHA-256 of the body (see [`sha256_hex`]), or `"UNSIGNED-PAYLOAD"`.
    pub payload_sha256: &'a str,
}

/// What the caller must send: every header that was signed and that the caller does not
/// already send.
///
/// Debug prints the session token as `"<redacted>"`.
#[derive(Clone, PartialEq, Eq)]
pub struct Signed {
    /// The `Authorization` header value: `AWS4-HMAC-SHA256 Credential=<key id>/<scope>,
    /// SignedHeaders=<names>, Signature=<64 hex>`.
    pub authorization: String,
    /// The `x-amz-date` header value, `"YYYYMMDDTHHMMSSZ"`.
    pub amz_date: String,
    /// The `x-amz-content-sha256` header value (the request's `payload_sha256`).
    pub content_sha256: String,
    /// The `x-amz-security-token` header value when the credentials carry a session token.
    pub security_token: Option<String>,
}

impl fmt::Debug for Signed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Signed")
            .field("authorization", &self.authorization)
            .field("amz_date", &self.amz_date)
            .field("content_sha256", &self.content_sha256)
            .field(
                "security_token",
                &self.security_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// Signs `req` for `region` and service `s3` at `amz_date` (`"YYYYMMDDTHHMMSSZ"`, see
/// [`amz_date`] and [`amz_date_now`]); the credential scope's date is its first 8 characters.
pub fn sign(req: &Request<'_>, creds: &Credentials, region: &str, amz_date: &str) -> Signed {
    let date = amz_date.get(..8).unwrap_or(amz_date);
    let scope = format!("{date}/{region}/{SERVICE}/{TERMINATOR}");
    let (canonical, signed_headers) =
        canonical_request(req, amz_date, creds.session_token.as_deref());
    let string_to_sign = format!(
        "{ALGORITHM}\n{amz_date}\n{scope}\n{}",
        sha256_hex(canonical.as_bytes())
    );
    let key = signing_key(&creds.secret_access_key, date, region);
    let signature = hex_lower(hmac::sign(&key, string_to_sign.as_bytes()).as_ref());
    Signed {
        authorization: format!(
            "{ALGORITHM} Credential={}/{scope}, SignedHeaders={signed_headers}, \
             Signature={signature}",
            creds.access_key_id
        ),
        amz_date: amz_date.to_owned(),
        content_sha256: req.payload_sha256.to_owned(),
        security_token: creds.session_token.clone(),
    }
}

/// The canonical request and the signed header names joined by `;` (exposed for tests and
/// debugging; [`sign`] uses it).
///
/// The signed headers are `host`, `x-amz-content-sha256`, `x-amz-date`,
/// `x-amz-security-token` (when `session_token` is given) and the request's own headers.
pub fn canonical_request(
    req: &Request<'_>,
    amz_date: &str,
    session_token: Option<&str>,
) -> (String, String) {
    let headers = canonical_headers(req, amz_date, session_token);
    let signed_headers = headers
        .iter()
        .map(|(name, _)| name.as_str())
        .collect::<Vec<_>>()
        .join(";");
    let header_block: String = headers
        .iter()
        .map(|(name, value)| format!("{name}:{value}\n"))
        .collect();
    let canonical = format!(
        "{}\n{}\n{}\n{header_block}\n{signed_headers}\n{}",
        req.method,
        canonical_uri(req.path),
        canonical_query(req.query),
        req.payload_sha256
    );
    (canonical, signed_headers)
}

/// SigV4's URI encoding: unreserved characters (`A-Z a-z 0-9 - _ . ~`) kept, every other byte
/// as `%XX` with uppercase hex; `/` kept when `keep_slash`.
pub fn uri_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for byte in s.bytes() {
        if is_unreserved(byte) || (keep_slash && byte == b'/') {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(hex_digit(byte >> 4, true));
            out.push(hex_digit(byte, true));
        }
    }
    out
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex_lower(digest::digest(&digest::SHA256, bytes).as_ref())
}

/// `"YYYYMMDDTHHMMSSZ"` for `unix_seconds` (UTC). Valid for years 1970..=9999 (up to
/// 253402300799); later instants get a year of more than four digits.
pub fn amz_date(unix_seconds: u64) -> String {
    let days = unix_seconds / SECONDS_PER_DAY;
    let second_of_day = unix_seconds % SECONDS_PER_DAY;
    let (year, month, day) = civil_from_days(days);
    let hour = second_of_day / 3600;
    let minute = second_of_day % 3600 / 60;
    let second = second_of_day % 60;
    format!("{year:04}{month:02}{day:02}T{hour:02}{minute:02}{second:02}Z")
}

/// [`amz_date`] of the system clock now (the Unix epoch if the clock reads earlier).
pub fn amz_date_now() -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs())
        .unwrap_or(0);
    amz_date(seconds)
}

/// The path with each segment URI-encoded and `/` kept; `/` for an empty path, and a leading
/// `/` added to a relative one.
fn canonical_uri(path: &str) -> String {
    if path.starts_with('/') {
        uri_encode(path, true)
    } else {
        format!("/{}", uri_encode(path, true))
    }
}

/// Each name and value encoded, sorted by encoded name then value, as `name=value` joined by
/// `&`.
fn canonical_query(query: &[(&str, &str)]) -> String {
    let mut pairs: Vec<(String, String)> = query
        .iter()
        .map(|(name, value)| (uri_encode(name, false), uri_encode(value, false)))
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// The signed headers as (lowercase name, canonical value), sorted by name, a repeated name's
/// values joined by `,` in the order given.
fn canonical_headers(
    req: &Request<'_>,
    amz_date: &str,
    session_token: Option<&str>,
) -> Vec<(String, String)> {
    let automatic = [
        Some(("host", req.host)),
        Some(("x-amz-content-sha256", req.payload_sha256)),
        Some(("x-amz-date", amz_date)),
        session_token.map(|token| ("x-amz-security-token", token)),
    ];
    let mut headers: Vec<(String, String)> = automatic
        .into_iter()
        .flatten()
        .chain(req.headers.iter().copied())
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), canonical_value(value)))
        .collect();
    // A stable sort keeps a repeated header's values in the order they were given.
    headers.sort_by(|a, b| a.0.cmp(&b.0));
    merge_repeated(headers)
}

/// Joins the values of adjacent headers of the same name with `,`.
fn merge_repeated(sorted: Vec<(String, String)>) -> Vec<(String, String)> {
    let mut merged: Vec<(String, String)> = Vec::with_capacity(sorted.len());
    for (name, value) in sorted {
        match merged.last_mut() {
            Some((last, joined)) if *last == name => {
                joined.push(',');
                joined.push_str(&value);
            }
            _ => merged.push((name, value)),
        }
    }
    merged
}

/// A header value trimmed of leading and trailing spaces and tabs, with inner runs of spaces
/// collapsed to one.
fn canonical_value(value: &str) -> String {
    let trimmed = value.trim_matches(|c| c == ' ' || c == '\t');
    let mut out = String::with_capacity(trimmed.len());
    let mut after_space = false;
    for c in trimmed.chars() {
        if c == ' ' {
            if !after_space {
                out.push(' ');
            }
            after_space = true;
        } else {
            out.push(c);
            after_space = false;
        }
    }
    out
}

/// The SigV4 signing key: HMAC-SHA256 of `"AWS4" + secret` over the date, then the region,
/// the service and the terminator.
fn signing_key(secret: &str, date: &str, region: &str) -> hmac::Key {
    let seed = hmac::Key::new(hmac::HMAC_SHA256, format!("AWS4{secret}").as_bytes());
    [date, region, SERVICE, TERMINATOR]
        .into_iter()
        .fold(seed, |key, part| {
            let tag = hmac::sign(&key, part.as_bytes());
            hmac::Key::new(hmac::HMAC_SHA256, tag.as_ref())
        })
}

/// Whether SigV4 keeps `byte` as it is (RFC 3986 unreserved).
fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~')
}

/// Lowercase hex of `bytes`.
fn hex_lower(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for &byte in bytes {
        out.push(hex_digit(byte >> 4, false));
        out.push(hex_digit(byte, false));
    }
    out
}

/// The hex digit of the low four bits of `nibble`.
fn hex_digit(nibble: u8, uppercase: bool) -> char {
    let nibble = nibble & 0x0f;
    let ascii = match (nibble, uppercase) {
        (0..=9, _) => b'0' + nibble,
        (_, true) => b'A' + nibble - 10,
        (_, false) => b'a' + nibble - 10,
    };
    char::from(ascii)
}

/// The proleptic Gregorian (year, month, day) of `days` since 1970-01-01.
///
/// Counts from 0000-03-01, so that the leap day ends a year, in 400-year eras of 146097 days:
/// the day of the era gives the year of the era (every 4th year is a leap year except every
/// 100th, except every 400th), the day of that March-based year gives the month (the months
/// from March repeat in a 153-day, 5-month pattern of 31 and 30 days) and the day.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    /// Days from 0000-03-01 to 1970-01-01.
    const EPOCH_SHIFT: u64 = 719_468;
    /// Days in a 400-year era.
    const DAYS_PER_ERA: u64 = 146_097;
    let shifted = days + EPOCH_SHIFT;
    let era = shifted / DAYS_PER_ERA;
    let day_of_era = shifted % DAYS_PER_ERA;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let march_year = era * 400 + year_of_era;
    let year = if month <= 2 {
        march_year + 1
    } else {
        march_year
    };
    (year, month, day)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::indexing_slicing,
        clippy::panic
    )]

    use super::*;
    use proptest::prelude::*;

    // The examples of the Amazon S3 API Reference, "Signature Calculations for the
    // Authorization Header: Transferring Payload in a Single Chunk (AWS Signature Version 4)",
    // section "Examples: Signature Calculations"
    // (https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html).
    const HOST: &str = "examplebucket.s3.amazonaws.com";
    const DATE: &str = "20130524T000000Z";
    const REGION: &str = "us-east-1";
    const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    fn example_credentials() -> Credentials {
        Credentials {
            access_key_id: "AKIAIOSFODNN7EXAMPLE".to_owned(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".to_owned(),
            session_token: None,
        }
    }

    fn get<'a>(
        path: &'a str,
        query: &'a [(&'a str, &'a str)],
        headers: &'a [(&'a str, &'a str)],
    ) -> Request<'a> {
        Request {
            method: "GET",
            host: HOST,
            path,
            query,
            headers,
            payload_sha256: EMPTY_SHA256,
        }
    }

    fn signature(signed: &Signed) -> &str {
        signed.authorization.rsplit("Signature=").next().unwrap()
    }

    fn canonical_hash(req: &Request<'_>) -> String {
        sha256_hex(canonical_request(req, DATE, None).0.as_bytes())
    }

    #[test]
    fn empty_payload_hash_is_the_sha256_of_nothing() {
        assert_eq!(sha256_hex(b""), EMPTY_SHA256);
    }

    #[test]
    fn aws_example_get_object() {
        let req = get("/test.txt", &[], &[("range", "bytes=0-9")]);
        let (canonical, signed_headers) = canonical_request(&req, DATE, None);
        assert_eq!(
            canonical,
            format!(
                "GET\n/test.txt\n\nhost:{HOST}\nrange:bytes=0-9\n\
                 x-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:{DATE}\n\n\
                 host;range;x-amz-content-sha256;x-amz-date\n{EMPTY_SHA256}"
            )
        );
        assert_eq!(signed_headers, "host;range;x-amz-content-sha256;x-amz-date");
        assert_eq!(
            canonical_hash(&req),
            "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972"
        );
        let signed = sign(&req, &example_credentials(), REGION, DATE);
        assert_eq!(
            signed.authorization,
            "AWS4-HMAC-SHA256 \
             Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, \
             SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, \
             Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
        assert_eq!(
            signed,
            Signed {
                authorization: signed.authorization.clone(),
                amz_date: DATE.to_owned(),
                content_sha256: EMPTY_SHA256.to_owned(),
                security_token: None,
            }
        );
    }

    #[test]
    fn aws_example_put_object() {
        let payload = sha256_hex(b"Welcome to Amazon S3.");
        assert_eq!(
            payload,
            "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072"
        );
        let req = Request {
            method: "PUT",
            host: HOST,
            path: "/test$file.text",
            query: &[],
            headers: &[
                ("date", "Fri, 24 May 2013 00:00:00 GMT"),
                ("x-amz-storage-class", "REDUCED_REDUNDANCY"),
            ],
            payload_sha256: &payload,
        };
        let (canonical, signed_headers) = canonical_request(&req, DATE, None);
        assert!(canonical.starts_with("PUT\n/test%24file.text\n\n"));
        assert_eq!(
            signed_headers,
            "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class"
        );
        assert_eq!(
            canonical_hash(&req),
            "9e0e90d9c76de8fa5b200d8c849cd5b8dc7a3be3951ddb7f6a76b4158342019d"
        );
        let signed = sign(&req, &example_credentials(), REGION, DATE);
        assert_eq!(
            signature(&signed),
            "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"
        );
        assert_eq!(signed.content_sha256, payload);
    }

    #[test]
    fn aws_example_get_bucket_lifecycle() {
        let req = get("/", &[("lifecycle", "")], &[]);
        let (canonical, signed_headers) = canonical_request(&req, DATE, None);
        assert!(canonical.starts_with("GET\n/\nlifecycle=\nhost:"));
        assert_eq!(signed_headers, "host;x-amz-content-sha256;x-amz-date");
        assert_eq!(
            canonical_hash(&req),
            "9766c798316ff2757b517bc739a67f6213b4ab36dd5da2f94eaebf79c77395ca"
        );
        let signed = sign(&req, &example_credentials(), REGION, DATE);
        assert_eq!(
            signature(&signed),
            "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543"
        );
    }

    #[test]
    fn aws_example_list_objects_sorts_the_query() {
        // Given out of order: the canonical query string sorts the parameters.
        let req = get("/", &[("prefix", "J"), ("max-keys", "2")], &[]);
        let (canonical, _) = canonical_request(&req, DATE, None);
        assert!(canonical.starts_with("GET\n/\nmax-keys=2&prefix=J\n"));
        assert_eq!(
            canonical_hash(&req),
            "df57d21db20da04d7fa30298dd4488ba3a2b47ca3a489c74750e0f1e7df1b9b7"
        );
        let signed = sign(&req, &example_credentials(), REGION, DATE);
        assert_eq!(
            signature(&signed),
            "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"
        );
    }

    #[test]
    fn uri_encode_keeps_only_unreserved_and_maybe_slash() {
        assert_eq!(uri_encode("a b", false), "a%20b");
        assert_eq!(uri_encode("a/b", true), "a/b");
        assert_eq!(uri_encode("a/b", false), "a%2Fb");
        assert_eq!(uri_encode("AZaz09-_.~", false), "AZaz09-_.~");
        assert_eq!(uri_encode("test$file", true), "test%24file");
        assert_eq!(uri_encode("a+b=c&d:e", true), "a%2Bb%3Dc%26d%3Ae");
        assert_eq!(uri_encode("é", false), "%C3%A9");
        assert_eq!(uri_encode("€", true), "%E2%82%AC");
        assert_eq!(uri_encode("", false), "");
    }

    #[test]
    fn paths_are_encoded_once_per_segment_and_not_normalised() {
        let canonical_path = |path| canonical_request(&get(path, &[], &[]), DATE, None).0;
        assert!(canonical_path("/bucket/a b/c:d").starts_with("GET\n/bucket/a%20b/c%3Ad\n"));
        assert!(canonical_path("/b/a%20b").starts_with("GET\n/b/a%2520b\n"));
        assert!(canonical_path("/b/./x/../y//z").starts_with("GET\n/b/./x/../y//z\n"));
        assert!(canonical_path("").starts_with("GET\n/\n"));
        assert!(canonical_path("key").starts_with("GET\n/key\n"));
    }

    #[test]
    fn query_names_and_values_are_encoded_then_sorted() {
        let req = get(
            "/",
            &[
                ("prefix", "a/b c"),
                ("list-type", "2"),
                ("a", "2"),
                ("a", "1"),
            ],
            &[],
        );
        let (canonical, _) = canonical_request(&req, DATE, None);
        assert!(canonical.starts_with("GET\n/\na=1&a=2&list-type=2&prefix=a%2Fb%20c\n"));
    }

    #[test]
    fn session_token_is_signed_and_returned() {
        let creds = Credentials {
            session_token: Some("FQoGZXIvYXdzEXAMPLE".to_owned()),
            ..example_credentials()
        };
        let req = get("/test.txt", &[], &[("range", "bytes=0-9")]);
        let (canonical, signed_headers) =
            canonical_request(&req, DATE, Some("FQoGZXIvYXdzEXAMPLE"));
        assert!(canonical.contains("\nx-amz-security-token:FQoGZXIvYXdzEXAMPLE\n"));
        assert_eq!(
            signed_headers,
            "host;range;x-amz-content-sha256;x-amz-date;x-amz-security-token"
        );
        let signed = sign(&req, &creds, REGION, DATE);
        assert_eq!(
            signed.security_token.as_deref(),
            Some("FQoGZXIvYXdzEXAMPLE")
        );
        assert!(signed.authorization.contains(
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date;x-amz-security-token, "
        ));
        let unsigned_token = sign(&req, &example_credentials(), REGION, DATE);
        assert_ne!(signature(&signed), signature(&unsigned_token));
    }

    #[test]
    fn header_names_and_values_are_canonicalised() {
        let messy = get(
            "/k",
            &[],
            &[
                ("X-Amz-Meta-Note", "  a   b\t c  "),
                ("Content-Type", "\ttext/plain "),
            ],
        );
        let clean = get(
            "/k",
            &[],
            &[
                ("x-amz-meta-note", "a b\t c"),
                ("content-type", "text/plain"),
            ],
        );
        let (canonical, signed_headers) = canonical_request(&messy, DATE, None);
        assert!(canonical.contains("\ncontent-type:text/plain\nhost:"));
        assert!(canonical.contains("\nx-amz-meta-note:a b\t c\n\n"));
        assert_eq!(
            signed_headers,
            "content-type;host;x-amz-content-sha256;x-amz-date;x-amz-meta-note"
        );
        assert_eq!(canonical, canonical_request(&clean, DATE, None).0);
        let creds = example_credentials();
        assert_eq!(
            sign(&messy, &creds, REGION, DATE),
            sign(&clean, &creds, REGION, DATE)
        );
    }

    #[test]
    fn a_repeated_header_is_signed_once_with_joined_values() {
        let req = get("/k", &[], &[("x-amz-meta-a", "2"), ("X-Amz-Meta-A", "1")]);
        let (canonical, signed_headers) = canonical_request(&req, DATE, None);
        assert!(canonical.contains("\nx-amz-meta-a:2,1\n"));
        assert_eq!(
            signed_headers,
            "host;x-amz-content-sha256;x-amz-date;x-amz-meta-a"
        );
    }

    #[test]
    fn unsigned_payload_is_signed_literally() {
        let req = Request {
            payload_sha256: "UNSIGNED-PAYLOAD",
            ..get("/k", &[], &[])
        };
        let (canonical, _) = canonical_request(&req, DATE, None);
        assert!(canonical.ends_with("\nx-amz-content-sha256:UNSIGNED-PAYLOAD\nx-amz-date:20130524T000000Z\n\nhost;x-amz-content-sha256;x-amz-date\nUNSIGNED-PAYLOAD"));
        let signed = sign(&req, &example_credentials(), REGION, DATE);
        assert_eq!(signed.content_sha256, "UNSIGNED-PAYLOAD");
    }

    #[test]
    fn credential_scope_uses_region_and_date() {
        let req = get("/k", &[], &[]);
        let signed = sign(
            &req,
            &example_credentials(),
            "eu-west-3",
            "20240229T235959Z",
        );
        assert!(signed.authorization.starts_with(
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20240229/eu-west-3/s3/aws4_request, "
        ));
        assert_eq!(signed.amz_date, "20240229T235959Z");
        assert_eq!(signature(&signed).len(), 64);
        assert!(
            signature(&signed)
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
    }

    #[test]
    fn amz_date_known_instants() {
        assert_eq!(amz_date(0), "19700101T000000Z");
        assert_eq!(amz_date(1_369_353_600), "20130524T000000Z");
        assert_eq!(amz_date(951_782_400), "20000229T000000Z");
        assert_eq!(amz_date(951_868_799), "20000229T235959Z");
        assert_eq!(amz_date(951_868_800), "20000301T000000Z");
        assert_eq!(amz_date(4_107_542_400), "21000301T000000Z"); // 2100 is not a leap year
        assert_eq!(amz_date(1_709_251_199), "20240229T235959Z");
        assert_eq!(amz_date(253_402_300_799), "99991231T235959Z");
    }

    #[test]
    fn amz_date_now_is_well_formed_and_recent() {
        let now = amz_date_now();
        assert_eq!(now.len(), 16);
        assert!(now.ends_with('Z'));
        assert_eq!(now.as_bytes()[8], b'T');
        assert!(now.as_str() > "20240101T000000Z");
    }

    #[test]
    fn debug_redacts_secrets() {
        let creds = Credentials {
            session_token: Some("the-session-token".to_owned()),
            ..example_credentials()
        };
        let shown = format!("{creds:?}");
        assert!(shown.contains("AKIAIOSFODNN7EXAMPLE"));
        assert!(shown.contains("<redacted>"));
        assert!(!shown.contains("wJalrXUtnFEMI"));
        assert!(!shown.contains("the-session-token"));
        let signed = sign(&get("/k", &[], &[]), &creds, REGION, DATE);
        let shown = format!("{signed:?}");
        assert!(!shown.contains("the-session-token"));
        assert!(!shown.contains("wJalrXUtnFEMI"));
    }

    /// The date of `unix_seconds` counted a year, then a month, at a time from 1970.
    fn naive_amz_date(unix_seconds: u64) -> String {
        let is_leap = |year: u64| {
            (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
        };
        let mut days = unix_seconds / SECONDS_PER_DAY;
        let mut year = 1970;
        while days >= if is_leap(year) { 366 } else { 365 } {
            days -= if is_leap(year) { 366 } else { 365 };
            year += 1;
        }
        let february = if is_leap(year) { 29 } else { 28 };
        let mut month = 1;
        for length in [31, february, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31] {
            if days < length {
                break;
            }
            days -= length;
            month += 1;
        }
        let second_of_day = unix_seconds % SECONDS_PER_DAY;
        format!(
            "{year:04}{month:02}{:02}T{:02}{:02}{:02}Z",
            days + 1,
            second_of_day / 3600,
            second_of_day % 3600 / 60,
            second_of_day % 60
        )
    }

    /// Decodes `%XX` escapes (the inverse of [`uri_encode`] for the tests).
    fn percent_decode(encoded: &str) -> Vec<u8> {
        let bytes = encoded.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                assert_eq!(hex, hex.to_ascii_uppercase(), "escapes use uppercase hex");
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        out
    }

    proptest! {
        #[test]
        fn amz_date_agrees_with_a_naive_calendar(seconds in 0u64..=253_402_300_799) {
            prop_assert_eq!(amz_date(seconds), naive_amz_date(seconds));
        }

        #[test]
        fn uri_encode_output_is_safe_and_decodes_back(s in any::<String>(), keep_slash: bool) {
            let encoded = uri_encode(&s, keep_slash);
            let safe = encoded
                .bytes()
                .all(|b| is_unreserved(b) || b == b'%' || (keep_slash && b == b'/'));
            prop_assert!(safe, "unexpected byte in {:?}", encoded);
            prop_assert_eq!(percent_decode(&encoded), s.as_bytes());
        }
    }
}
