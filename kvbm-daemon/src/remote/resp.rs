//! RESP2, the Redis wire protocol: encoding commands and parsing replies, pure and bounded.
//!
//! A reply is parsed from the front of a buffer; [`Parsed::Incomplete`] asks for more bytes.
//! Bulk strings larger than the caller's bound, arrays longer than [`MAX_ARRAY`] or nested
//! deeper than [`MAX_DEPTH`], and lines longer than [`MAX_LINE`] are errors. The client also
//! caps what it buffers for one reply (one bulk value and its framing), so a misbehaving
//! server cannot make the daemon allocate without limit.

use bytes::Bytes;

/// The longest status, error or integer line accepted.
pub const MAX_LINE: usize = 4096;
/// The most elements of an array reply.
pub const MAX_ARRAY: usize = 1024;
/// The deepest nesting of array replies.
pub const MAX_DEPTH: usize = 4;

/// One reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK` and other status lines.
    Status(String),
    /// `-ERR …`: the server refused the command.
    Error(String),
    /// `:n`.
    Integer(i64),
    /// `$n` bulk string; `None` for the null bulk (`$-1`, e.g. GET of a missing key).
    Bulk(Option<Bytes>),
    /// `*n` array; `None` for the null array.
    Array(Option<Vec<Reply>>),
}

/// The outcome of parsing the front of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// A whole reply, and how many bytes it took.
    Done(Reply, usize),
    /// The buffer ends inside a reply.
    Incomplete,
}

/// A reply that breaks the protocol or a bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RespError {
    /// The first byte is not a RESP2 type.
    #[error("unexpected reply type byte {0:#04x}")]
    Type(u8),
    /// A length or integer line is not a number.
    #[error("malformed number in reply: {0:?}")]
    Number(String),
    /// A line or bulk string is not terminated by CRLF.
    #[error("reply element not terminated by CRLF")]
    Terminator,
    /// A bound was exceeded.
    #[error("reply {what} {got} exceeds the limit {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The bound.
        limit: usize,
    },
}

/// Appends a command (an array of bulk strings) to `out`.
pub fn encode(args: &[&[u8]], out: &mut Vec<u8>) {
    out.push(b'*');
    out.extend_from_slice(args.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for a in args {
        out.push(b'$');
        out.extend_from_slice(a.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// Parses one reply from the front of `buf`, refusing bulk strings over `max_bulk` bytes.
pub fn parse(buf: &[u8], max_bulk: usize) -> Result<Parsed, RespError> {
    Ok(match parse_at(buf, 0, max_bulk, 0)? {
        Some((reply, end)) => Parsed::Done(reply, end),
        None => Parsed::Incomplete,
    })
}

/// The line starting at `at` (without its CRLF) and the offset after it.
fn line(buf: &[u8], at: usize) -> Result<Option<(&[u8], usize)>, RespError> {
    let rest = buf.get(at..).unwrap_or_default();
    let window = rest.get(..MAX_LINE + 2).unwrap_or(rest);
    match window.windows(2).position(|w| w == b"\r\n") {
        Some(p) => Ok(Some((rest.get(..p).unwrap_or_default(), at + p + 2))),
        None if rest.len() > MAX_LINE + 1 => Err(RespError::TooLarge {
            what: "line",
            got: rest.len(),
            limit: MAX_LINE,
        }),
        None => Ok(None),
    }
}

fn number(text: &[u8]) -> Result<i64, RespError> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| RespError::Number(String::from_utf8_lossy(text).into_owned()))
}

/// A length: -1 for null, otherwise at most `limit`.
fn length(text: &[u8], what: &'static str, limit: usize) -> Result<Option<usize>, RespError> {
    let n = number(text)?;
    if n == -1 {
        return Ok(None);
    }
    let n = usize::try_from(n).map_err(|_| RespError::Number(n.to_string()))?;
    if n > limit {
        return Err(RespError::TooLarge {
            what,
            got: n,
            limit,
        });
    }
    Ok(Some(n))
}

fn parse_at(
    buf: &[u8],
    at: usize,
    max_bulk: usize,
    depth: usize,
) -> Result<Option<(Reply, usize)>, RespError> {
    let Some(&kind) = buf.get(at) else {
        return Ok(None);
    };
    let Some((text, next)) = line(buf, at + 1)? else {
        return Ok(None);
    };
    let text_string = || String::from_utf8_lossy(text).into_owned();
    Ok(Some(match kind {
        b'+' => (Reply::Status(text_string()), next),
        b'-' => (Reply::Error(text_string()), next),
        b':' => (Reply::Integer(number(text)?), next),
        b'$' => match length(text, "bulk length", max_bulk)? {
            None => (Reply::Bulk(None), next),
            Some(n) => {
                let end = next + n;
                let (Some(value), Some(terminator)) = (buf.get(next..end), buf.get(end..end + 2))
                else {
                    return Ok(None);
                };
                if terminator != b"\r\n" {
                    return Err(RespError::Terminator);
                }
                (Reply::Bulk(Some(Bytes::copy_from_slice(value))), end + 2)
            }
        },
        b'*' => {
            if depth >= MAX_DEPTH {
                return Err(RespError::TooLarge {
                    what: "nesting",
                    got: depth + 1,
                    limit: MAX_DEPTH,
                });
            }
            match length(text, "array length", MAX_ARRAY)? {
                None => (Reply::Array(None), next),
                Some(n) => {
                    let mut items = Vec::with_capacity(n);
                    let mut pos = next;
                    for _ in 0..n {
                        let Some((item, after)) = parse_at(buf, pos, max_bulk, depth + 1)? else {
                            return Ok(None);
                        };
                        items.push(item);
                        pos = after;
                    }
                    (Reply::Array(Some(items)), pos)
                }
            }
        }
        other => return Err(RespError::Type(other)),
    }))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn done(buf: &[u8]) -> (Reply, usize) {
        match parse(buf, 1 << 20).unwrap() {
            Parsed::Done(r, n) => (r, n),
            Parsed::Incomplete => panic!("incomplete: {buf:?}"),
        }
    }

    #[test]
    fn encodes_a_command_as_an_array_of_bulk_strings() {
        let mut out = Vec::new();
        encode(&[b"SET", b"k", b"a\r\nb"], &mut out);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n");
    }

    #[test]
    fn parses_every_reply_type() {
        assert_eq!(done(b"+OK\r\n"), (Reply::Status("OK".into()), 5));
        assert_eq!(
            done(b"-ERR wrong\r\n"),
            (Reply::Error("ERR wrong".into()), 12)
        );
        assert_eq!(done(b":-3\r\n"), (Reply::Integer(-3), 5));
        assert_eq!(done(b"$-1\r\n"), (Reply::Bulk(None), 5));
        assert_eq!(
            done(b"$4\r\na\r\nb\r\nextra"),
            (Reply::Bulk(Some(Bytes::from_static(b"a\r\nb"))), 10)
        );
        assert_eq!(
            done(b"*2\r\n:1\r\n$1\r\nx\r\n"),
            (
                Reply::Array(Some(vec![
                    Reply::Integer(1),
                    Reply::Bulk(Some(Bytes::from_static(b"x")))
                ])),
                15
            )
        );
        assert_eq!(done(b"*-1\r\n"), (Reply::Array(None), 5));
    }

    #[test]
    fn bounds_and_malformed_replies_are_errors() {
        assert_eq!(parse(b"?x\r\n", 8), Err(RespError::Type(b'?')));
        assert!(matches!(parse(b":x\r\n", 8), Err(RespError::Number(_))));
        assert!(matches!(
            parse(b"$9\r\n", 8),
            Err(RespError::TooLarge {
                what: "bulk length",
                ..
            })
        ));
        assert_eq!(parse(b"$1\r\nab\r\n", 8), Err(RespError::Terminator));
        let long = [b"+".as_slice(), &vec![b'a'; MAX_LINE + 10]].concat();
        assert!(matches!(
            parse(&long, 8),
            Err(RespError::TooLarge { what: "line", .. })
        ));
        let deep = b"*1\r\n".repeat(MAX_DEPTH + 1);
        assert!(matches!(
            parse(&deep, 8),
            Err(RespError::TooLarge {
                what: "nesting",
                ..
            })
        ));
        assert!(matches!(
            parse(format!("*{}\r\n", MAX_ARRAY + 1).as_bytes(), 8),
            Err(RespError::TooLarge {
                what: "array length",
                ..
            })
        ));
    }

    proptest! {
        /// Every strict prefix of a valid reply is incomplete; the whole is done at its length.
        #[test]
        fn prefixes_are_incomplete(value in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut buf = Vec::new();
            encode(&[&value, b"x"], &mut buf);
            for cut in 0..buf.len() {
                prop_assert_eq!(parse(&buf[..cut], 1024), Ok(Parsed::Incomplete));
            }
            let (reply, n) = done(&buf);
            prop_assert_eq!(n, buf.len());
            prop_assert_eq!(reply, Reply::Array(Some(vec![
                Reply::Bulk(Some(Bytes::from(value))),
                Reply::Bulk(Some(Bytes::from_static(b"x"))),
            ])));
        }
    }
}
