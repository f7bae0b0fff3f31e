//! A minimal, zero-copy MessagePack reader and a minimal-width writer.
//!
//! Only what the engines' KV-event payloads use: nil, bool, integers, floats, strings, binary,
//! arrays and maps (extension types are skipped when they appear in ignored fields). The reader
//! borrows from the input, checks every declared length against the bytes that remain (so a
//! hostile length cannot trigger a large allocation), and limits nesting depth when skipping.
//! The writer always picks the narrowest encoding, as `msgspec` and `msgpack-python` do, so
//! payloads re-encode byte for byte.

use std::fmt;

/// Deepest nesting [`Reader::skip_value`] accepts.
pub const MAX_DEPTH: usize = 32;

/// What went wrong while reading MessagePack.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("msgpack: {kind} at byte {offset}")]
pub struct Error {
    /// Byte offset in the buffer where the problem was found.
    pub offset: usize,
    /// What kind of problem.
    pub kind: ErrorKind,
}

/// The kinds of MessagePack decoding errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// The buffer ended inside a value.
    Truncated,
    /// A value of another type was found.
    UnexpectedType {
        /// What the caller wanted.
        expected: &'static str,
        /// The marker byte found.
        found: u8,
    },
    /// The byte 0xc1, never used by MessagePack.
    ReservedMarker,
    /// An integer outside the range the caller accepts.
    IntegerOutOfRange,
    /// A string that is not UTF-8.
    InvalidUtf8,
    /// Nesting deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A declared length larger than the bytes that remain.
    LengthTooLarge(u64),
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated => f.write_str("unexpected end of input"),
            Self::UnexpectedType { expected, found } => {
                write!(f, "expected {expected}, found marker 0x{found:02x}")
            }
            Self::ReservedMarker => f.write_str("reserved marker 0xc1"),
            Self::IntegerOutOfRange => f.write_str("integer out of range"),
            Self::InvalidUtf8 => f.write_str("string is not valid UTF-8"),
            Self::TooDeep => write!(f, "nesting deeper than {MAX_DEPTH}"),
            Self::LengthTooLarge(n) => write!(f, "declared length {n} exceeds the remaining input"),
        }
    }
}

/// Result alias for this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An integer as it appeared on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    /// A non-negative value (any unsigned or signed encoding).
    Unsigned(u64),
    /// A negative value.
    Negative(i64),
}

/// A borrowed view of one MessagePack value's kind, without its children.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Head<'a> {
    /// `nil`.
    Nil,
    /// `true` / `false`.
    Bool(bool),
    /// Any integer.
    Int(Int),
    /// float32 or float64.
    Float(f64),
    /// A UTF-8 string (validated).
    Str(&'a str),
    /// Binary data.
    Bin(&'a [u8]),
    /// An array of this many elements (the elements follow).
    Array(usize),
    /// A map of this many pairs (keys and values follow).
    Map(usize),
    /// An extension value (type, data).
    Ext(i8, &'a [u8]),
}

/// A cursor over a MessagePack buffer.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Starts reading at the beginning of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// The current byte offset.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The bytes between two offsets previously returned by [`Reader::position`].
    pub fn slice(&self, from: usize, to: usize) -> &'a [u8] {
        self.buf.get(from..to).unwrap_or_default()
    }

    fn err(&self, kind: ErrorKind) -> Error {
        Error {
            offset: self.pos,
            kind,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .ok_or_else(|| self.err(ErrorKind::Truncated))?;
        let bytes = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| self.err(ErrorKind::Truncated))?;
        self.pos = end;
        Ok(bytes)
    }

    fn byte(&mut self) -> Result<u8> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| self.err(ErrorKind::Truncated))?;
        self.pos += 1;
        Ok(b)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N]> {
        let bytes = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn len_of<const N: usize>(&mut self) -> Result<usize> {
        let raw = self.be::<N>()?;
        let mut v: u64 = 0;
        for b in raw {
            v = (v << 8) | u64::from(b);
        }
        usize::try_from(v).map_err(|_| self.err(ErrorKind::LengthTooLarge(v)))
    }

    /// Checks that `count` items of at least `min_size` bytes each can still follow.
    fn check_count(&self, count: usize, min_size: usize) -> Result<usize> {
        let needed = count.saturating_mul(min_size);
        if needed > self.remaining() {
            return Err(self.err(ErrorKind::LengthTooLarge(count as u64)));
        }
        Ok(count)
    }

    /// Peeks at the next marker byte without consuming it.
    pub fn peek_marker(&self) -> Result<u8> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.err(ErrorKind::Truncated))
    }

    /// True when the next value is `nil`; consumes it in that case.
    pub fn eat_nil(&mut self) -> Result<bool> {
        if self.peek_marker()? == 0xc0 {
            self.pos += 1;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Reads the head of the next value. Strings, binaries and extensions are read whole;
    /// arrays and maps leave their children to be read next.
    pub fn head(&mut self) -> Result<Head<'a>> {
        let start = self.pos;
        let marker = self.byte()?;
        let head = match marker {
            0x00..=0x7f => Head::Int(Int::Unsigned(u64::from(marker))),
            0x80..=0x8f => Head::Map(self.check_count(usize::from(marker & 0x0f), 2)?),
            0x90..=0x9f => Head::Array(self.check_count(usize::from(marker & 0x0f), 1)?),
            0xa0..=0xbf => self.str_of(usize::from(marker & 0x1f), start)?,
            0xc0 => Head::Nil,
            0xc1 => {
                self.pos = start;
                return Err(self.err(ErrorKind::ReservedMarker));
            }
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => {
                let n = self.len_of::<1>()?;
                Head::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.len_of::<2>()?;
                Head::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.len_of::<4>()?;
                Head::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = match marker {
                    0xc7 => self.len_of::<1>()?,
                    0xc8 => self.len_of::<2>()?,
                    _ => self.len_of::<4>()?,
                };
                let ty = i8::from_be_bytes(self.be::<1>()?);
                Head::Ext(ty, self.take(n)?)
            }
            0xca => Head::Float(f64::from(f32::from_be_bytes(self.be::<4>()?))),
            0xcb => Head::Float(f64::from_be_bytes(self.be::<8>()?)),
            0xcc => Head::Int(Int::Unsigned(u64::from(self.byte()?))),
            0xcd => Head::Int(Int::Unsigned(u64::from(u16::from_be_bytes(self.be()?)))),
            0xce => Head::Int(Int::Unsigned(u64::from(u32::from_be_bytes(self.be()?)))),
            0xcf => Head::Int(Int::Unsigned(u64::from_be_bytes(self.be()?))),
            0xd0 => Head::Int(signed(i64::from(i8::from_be_bytes(self.be()?)))),
            0xd1 => Head::Int(signed(i64::from(i16::from_be_bytes(self.be()?)))),
            0xd2 => Head::Int(signed(i64::from(i32::from_be_bytes(self.be()?)))),
            0xd3 => Head::Int(signed(i64::from_be_bytes(self.be()?))),
            0xd4..=0xd8 => {
                let n = 1usize << (marker - 0xd4);
                let ty = i8::from_be_bytes(self.be::<1>()?);
                Head::Ext(ty, self.take(n)?)
            }
            0xd9 => {
                let n = self.len_of::<1>()?;
                self.str_of(n, start)?
            }
            0xda => {
                let n = self.len_of::<2>()?;
                self.str_of(n, start)?
            }
            0xdb => {
                let n = self.len_of::<4>()?;
                self.str_of(n, start)?
            }
            0xdc => {
                let n = self.len_of::<2>()?;
                Head::Array(self.check_count(n, 1)?)
            }
            0xdd => {
                let n = self.len_of::<4>()?;
                Head::Array(self.check_count(n, 1)?)
            }
            0xde => {
                let n = self.len_of::<2>()?;
                Head::Map(self.check_count(n, 2)?)
            }
            0xdf => {
                let n = self.len_of::<4>()?;
                Head::Map(self.check_count(n, 2)?)
            }
            0xe0..=0xff => Head::Int(Int::Negative(i64::from(marker as i8))),
        };
        Ok(head)
    }

    fn str_of(&mut self, n: usize, start: usize) -> Result<Head<'a>> {
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes)
            .map(Head::Str)
            .map_err(|_| Error {
                offset: start,
                kind: ErrorKind::InvalidUtf8,
            })
    }

    fn unexpected(&self, start: usize, expected: &'static str) -> Error {
        let found = self.buf.get(start).copied().unwrap_or(0);
        Error {
            offset: start,
            kind: ErrorKind::UnexpectedType { expected, found },
        }
    }

    /// Reads an array header.
    pub fn array_len(&mut self) -> Result<usize> {
        let start = self.pos;
        match self.head()? {
            Head::Array(n) => Ok(n),
            _ => Err(self.unexpected(start, "array")),
        }
    }

    /// Reads a map header.
    pub fn map_len(&mut self) -> Result<usize> {
        let start = self.pos;
        match self.head()? {
            Head::Map(n) => Ok(n),
            _ => Err(self.unexpected(start, "map")),
        }
    }

    /// Reads a string.
    pub fn str(&mut self) -> Result<&'a str> {
        let start = self.pos;
        match self.head()? {
            Head::Str(s) => Ok(s),
            _ => Err(self.unexpected(start, "string")),
        }
    }

    /// Reads a string or `nil`.
    pub fn opt_str(&mut self) -> Result<Option<&'a str>> {
        if self.eat_nil()? {
            Ok(None)
        } else {
            self.str().map(Some)
        }
    }

    /// Reads any integer.
    pub fn int(&mut self) -> Result<Int> {
        let start = self.pos;
        match self.head()? {
            Head::Int(i) => Ok(i),
            _ => Err(self.unexpected(start, "integer")),
        }
    }

    /// Reads a non-negative integer.
    pub fn u64(&mut self) -> Result<u64> {
        let start = self.pos;
        match self.int()? {
            Int::Unsigned(v) => Ok(v),
            Int::Negative(_) => Err(Error {
                offset: start,
                kind: ErrorKind::IntegerOutOfRange,
            }),
        }
    }

    /// Reads an integer that fits in an `i64`.
    pub fn i64(&mut self) -> Result<i64> {
        let start = self.pos;
        match self.int()? {
            Int::Unsigned(v) => i64::try_from(v).map_err(|_| Error {
                offset: start,
                kind: ErrorKind::IntegerOutOfRange,
            }),
            Int::Negative(v) => Ok(v),
        }
    }

    /// Reads an integer that fits in a `u32`.
    pub fn u32(&mut self) -> Result<u32> {
        let start = self.pos;
        let v = self.u64()?;
        u32::try_from(v).map_err(|_| Error {
            offset: start,
            kind: ErrorKind::IntegerOutOfRange,
        })
    }

    /// Reads an `i64` or `nil`.
    pub fn opt_i64(&mut self) -> Result<Option<i64>> {
        if self.eat_nil()? {
            Ok(None)
        } else {
            self.i64().map(Some)
        }
    }

    /// Reads a float (either width) or an integer, as `f64`.
    pub fn number(&mut self) -> Result<f64> {
        let start = self.pos;
        match self.head()? {
            Head::Float(f) => Ok(f),
            #[allow(clippy::cast_precision_loss)]
            Head::Int(Int::Unsigned(v)) => Ok(v as f64),
            #[allow(clippy::cast_precision_loss)]
            Head::Int(Int::Negative(v)) => Ok(v as f64),
            _ => Err(self.unexpected(start, "number")),
        }
    }

    /// Skips one whole value, children included, and returns its bytes.
    pub fn skip_value(&mut self) -> Result<&'a [u8]> {
        let start = self.pos;
        self.skip_depth(0)?;
        Ok(self.slice(start, self.pos))
    }

    fn skip_depth(&mut self, depth: usize) -> Result<()> {
        if depth >= MAX_DEPTH {
            return Err(self.err(ErrorKind::TooDeep));
        }
        match self.head()? {
            Head::Array(n) => {
                for _ in 0..n {
                    self.skip_depth(depth + 1)?;
                }
            }
            Head::Map(n) => {
                for _ in 0..n.saturating_mul(2) {
                    self.skip_depth(depth + 1)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

fn signed(v: i64) -> Int {
    if v < 0 {
        Int::Negative(v)
    } else {
        Int::Unsigned(v.unsigned_abs())
    }
}

/// A MessagePack writer that always uses the narrowest encoding.
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The bytes written so far.
    pub fn into_inner(self) -> Vec<u8> {
        self.buf
    }

    /// Writes `nil`.
    pub fn nil(&mut self) {
        self.buf.push(0xc0);
    }

    /// Writes a boolean.
    pub fn bool(&mut self, v: bool) {
        self.buf.push(if v { 0xc3 } else { 0xc2 });
    }

    /// Writes a non-negative integer.
    pub fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.buf.push(v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            self.buf.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(v) {
            self.buf.push(0xcd);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            self.buf.push(0xce);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else {
            self.buf.push(0xcf);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Writes a signed integer (non-negative values use the unsigned encodings).
    pub fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v.unsigned_abs());
        } else if v >= -32 {
            self.buf.push(v as u8);
        } else if let Ok(v) = i8::try_from(v) {
            self.buf.push(0xd0);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = i16::try_from(v) {
            self.buf.push(0xd1);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = i32::try_from(v) {
            self.buf.push(0xd2);
            self.buf.extend_from_slice(&v.to_be_bytes());
        } else {
            self.buf.push(0xd3);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// Writes a float64.
    pub fn f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    /// Writes a string.
    pub fn str(&mut self, s: &str) {
        let n = s.len();
        if n < 32 {
            self.buf.push(0xa0 | n as u8);
        } else {
            self.len_head(n, [0xd9, 0xda, 0xdb]);
        }
        self.buf.extend_from_slice(s.as_bytes());
    }

    /// Writes binary data.
    pub fn bin(&mut self, b: &[u8]) {
        self.len_head(b.len(), [0xc4, 0xc5, 0xc6]);
        self.buf.extend_from_slice(b);
    }

    /// Writes an array header.
    pub fn array(&mut self, n: usize) {
        if n < 16 {
            self.buf.push(0x90 | n as u8);
        } else {
            self.len_head16(n, [0xdc, 0xdd]);
        }
    }

    /// Writes a map header.
    pub fn map(&mut self, n: usize) {
        if n < 16 {
            self.buf.push(0x80 | n as u8);
        } else {
            self.len_head16(n, [0xde, 0xdf]);
        }
    }

    /// Appends bytes that already are one or more encoded values.
    pub fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    fn len_head(&mut self, n: usize, markers: [u8; 3]) {
        let [m8, m16, m32] = markers;
        if let Ok(n) = u8::try_from(n) {
            self.buf.extend_from_slice(&[m8, n]);
        } else {
            self.len_head16(n, [m16, m32]);
        }
    }

    fn len_head16(&mut self, n: usize, markers: [u8; 2]) {
        let [m16, m32] = markers;
        if let Ok(n) = u16::try_from(n) {
            self.buf.push(m16);
            self.buf.extend_from_slice(&n.to_be_bytes());
        } else {
            // Lengths beyond u32 cannot be encoded; callers bound their inputs far below that.
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            self.buf.push(m32);
            self.buf.extend_from_slice(&n.to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ints_use_minimal_widths() {
        let cases: &[(i64, &[u8])] = &[
            (5, &[0x05]),
            (127, &[0x7f]),
            (128, &[0xcc, 0x80]),
            (255, &[0xcc, 0xff]),
            (256, &[0xcd, 0x01, 0x00]),
            (65536, &[0xce, 0x00, 0x01, 0x00, 0x00]),
            (-1, &[0xff]),
            (-32, &[0xe0]),
            (-33, &[0xd0, 0xdf]),
            (-129, &[0xd1, 0xff, 0x7f]),
        ];
        for (v, want) in cases {
            let mut w = Writer::new();
            w.int(*v);
            assert_eq!(w.into_inner(), *want, "encoding {v}");
        }
    }

    #[test]
    fn declared_lengths_are_checked_before_use() {
        // array32 claiming 4 billion elements in a 5-byte buffer.
        let buf = [0xdd, 0xff, 0xff, 0xff, 0xff];
        let err = Reader::new(&buf).array_len().unwrap_err();
        assert!(matches!(err.kind, ErrorKind::LengthTooLarge(_)));
        let buf = [0xdb, 0xff, 0xff, 0xff, 0xff, b'a'];
        assert_eq!(
            Reader::new(&buf).str().unwrap_err().kind,
            ErrorKind::Truncated
        );
    }

    #[test]
    fn deep_nesting_is_refused() {
        let buf = vec![0x91; 100];
        let err = Reader::new(&buf).skip_value().unwrap_err();
        assert_eq!(err.kind, ErrorKind::TooDeep);
    }

    #[test]
    fn reserved_marker_and_bad_utf8() {
        assert_eq!(
            Reader::new(&[0xc1]).head().unwrap_err().kind,
            ErrorKind::ReservedMarker
        );
        assert_eq!(
            Reader::new(&[0xa1, 0xff]).str().unwrap_err().kind,
            ErrorKind::InvalidUtf8
        );
    }

    proptest! {
        #[test]
        fn ints_round_trip(v in any::<i64>()) {
            let mut w = Writer::new();
            w.int(v);
            let buf = w.into_inner();
            let mut r = Reader::new(&buf);
            prop_assert_eq!(r.i64().unwrap(), v);
            prop_assert_eq!(r.remaining(), 0);
        }

        #[test]
        fn uints_round_trip(v in any::<u64>()) {
            let mut w = Writer::new();
            w.uint(v);
            let buf = w.into_inner();
            prop_assert_eq!(Reader::new(&buf).u64().unwrap(), v);
        }

        #[test]
        fn strings_and_bins_round_trip(s in ".{0,300}", b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut w = Writer::new();
            w.str(&s);
            w.bin(&b);
            w.array(20);
            w.map(20);
            let buf = w.into_inner();
            let mut r = Reader::new(&buf);
            prop_assert_eq!(r.str().unwrap(), s.as_str());
            prop_assert_eq!(r.head().unwrap(), Head::Bin(&b));
        }

        #[test]
        fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut r = Reader::new(&buf);
            while r.remaining() > 0 {
                if r.skip_value().is_err() { break; }
            }
        }
    }
}
