//! Python's text forms of template values, so that rendered prompts match jinja2 byte for byte:
//! `str()` (what `{{ value }}` prints in jinja2: `None`, `True`, `{'a': 1}`) and
//! `json.dumps(…, ensure_ascii=False)` (Hugging Face's `tojson` filter: `{"a": 1}` with spaces,
//! keys in insertion order, non-ASCII kept).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Python `str(value)`: strings as they are, everything else as `repr`.
pub(crate) fn python_str(value: &Value) -> Result<String, Error> {
    if let Some(s) = value.as_str() {
        return Ok(s.to_owned());
    }
    if value.is_undefined() {
        return Ok(String::new());
    }
    let mut out = String::new();
    write_repr(&mut out, value, 0)?;
    Ok(out)
}

/// Nesting deeper than this is refused rather than risking the stack.
const MAX_DEPTH: usize = 256;

fn too_deep() -> Error {
    Error::new(ErrorKind::InvalidOperation, "value nested too deeply")
}

/// Python `repr(value)` for the JSON-like values a chat template sees.
fn write_repr(out: &mut String, value: &Value, depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(too_deep());
    }
    match value.kind() {
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value, false),
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item, depth + 1)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &key, depth + 1)?;
                out.push_str(": ");
                write_repr(out, &value.get_item(&key)?, depth + 1)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Numbers as Python prints them: integers plainly, floats by `float.__repr__`, or by
/// `json.dumps` (`Infinity`, `NaN`) when `json` is set.
fn write_number(out: &mut String, value: &Value, json: bool) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(f) => write_float(out, f, json),
        Err(_) => {
            let _ = write!(out, "{value}");
        }
    }
}

/// `float.__repr__`: the shortest digits that round-trip, in fixed notation when the decimal
/// exponent is in `-4..16` (always with a `.0` or a fraction), else as `d.ddde+XX`.
pub(crate) fn write_float(out: &mut String, f: f64, json: bool) {
    if f.is_nan() {
        out.push_str(if json { "NaN" } else { "nan" });
        return;
    }
    if f.is_infinite() {
        let s = match (json, f > 0.0) {
            (true, true) => "Infinity",
            (true, false) => "-Infinity",
            (false, true) => "inf",
            (false, false) => "-inf",
        };
        out.push_str(s);
        return;
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let fixed = format!("{f}");
        out.push_str(&fixed);
        if !fixed.contains('.') {
            out.push_str(".0");
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        let _ = write!(out, "{mantissa}e{sign}{:02}", exp.unsigned_abs());
    }
}

/// Python's `repr` of a string: single quotes unless the text has a `'` and no `"`.
fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_printable(c) => out.push(c),
            c => {
                let cp = u32::from(c);
                let _ = if cp < 0x100 {
                    write!(out, "\\x{cp:02x}")
                } else if cp < 0x1_0000 {
                    write!(out, "\\u{cp:04x}")
                } else {
                    write!(out, "\\U{cp:08x}")
                };
            }
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for one character, without Unicode tables: control, format,
/// separator (other than the space), surrogate and private-use characters are not printable;
/// unassigned code points are taken as printable.
fn is_printable(c: char) -> bool {
    let cp = u32::from(c);
    !(c.is_control()
        || matches!(
            cp,
            0x00A0
                | 0x00AD
                | 0x0600..=0x0605
                | 0x061C
                | 0x06DD
                | 0x070F
                | 0x08E2
                | 0x1680
                | 0x180E
                | 0x2000..=0x200F
                | 0x2028..=0x202F
                | 0x205F..=0x2064
                | 0x2066..=0x206F
                | 0x3000
                | 0xE000..=0xF8FF
                | 0xFEFF
                | 0xFFF9..=0xFFFB
                | 0x110BD
                | 0x110CD
                | 0x13430..=0x1343F
                | 0x1BCA0..=0x1BCA3
                | 0x1D173..=0x1D17A
                | 0xE0001
                | 0xE0020..=0xE007F
                | 0xF0000..=0x10FFFF
        ))
}

/// Options of Python's `json.dumps` that Hugging Face's `tojson` exposes.
#[derive(Debug)]
pub(crate) struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Default for JsonOptions {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".to_owned(),
            key_sep: ": ".to_owned(),
            sort_keys: false,
        }
    }
}

impl JsonOptions {
    /// Reads `ensure_ascii`, `indent`, `separators` and `sort_keys` from the filter's keyword
    /// arguments, with Python's defaults (separators `(', ', ': ')`, or `(',', ': ')` with an indent).
    fn from_kwargs(kwargs: &Kwargs) -> Result<Self, Error> {
        let mut opts = Self::default();
        if let Some(v) = kwargs.get::<Option<bool>>("ensure_ascii")? {
            opts.ensure_ascii = v;
        }
        if let Some(indent) = kwargs.get::<Option<Value>>("indent")? {
            if indent.is_none() {
                // indent=None: the default.
            } else if let Some(s) = indent.as_str() {
                opts.indent = Some(s.to_owned());
            } else if let Some(n) = indent.as_i64() {
                opts.indent = Some(" ".repeat(usize::try_from(n).unwrap_or(0).min(64)));
            } else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
            if opts.indent.is_some() {
                opts.item_sep = ",".to_owned();
            }
        }
        if let Some(seps) = kwargs.get::<Option<Value>>("separators")?
            && !seps.is_none()
        {
            let mut it = seps.try_iter()?;
            match (it.next(), it.next(), it.next()) {
                (Some(a), Some(b), None) if a.as_str().is_some() && b.as_str().is_some() => {
                    opts.item_sep = a.as_str().unwrap_or_default().to_owned();
                    opts.key_sep = b.as_str().unwrap_or_default().to_owned();
                }
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        if let Some(v) = kwargs.get::<Option<bool>>("sort_keys")? {
            opts.sort_keys = v;
        }
        kwargs.assert_all_used()?;
        Ok(opts)
    }
}

/// The `tojson` filter as Hugging Face defines it: `json.dumps(x, ensure_ascii=False, …)`.
pub(crate) fn tojson_filter(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let opts = JsonOptions::from_kwargs(&kwargs)?;
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

/// The `string` filter as jinja2 defines it: Python `str()`.
pub(crate) fn string_filter(value: &Value) -> Result<Value, Error> {
    python_str(value).map(Value::from)
}

fn newline_indent(out: &mut String, opts: &JsonOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

/// `json.dumps` of one value.
pub(crate) fn write_json(
    out: &mut String,
    value: &Value,
    opts: &JsonOptions,
    level: usize,
) -> Result<(), Error> {
    if level > MAX_DEPTH {
        return Err(too_deep());
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value, true),
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), opts),
        ValueKind::Seq | ValueKind::Iterable => {
            let items = value.try_iter()?.collect::<Vec<_>>();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys = value.try_iter()?.collect::<Vec<_>>();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                write_json_key(out, key, opts)?;
                out.push_str(&opts.key_sep);
                write_json(out, &value.get_item(key)?, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: a value of kind {} is not JSON serializable",
                    value.kind()
                ),
            ));
        }
    }
    Ok(())
}

/// Dictionary keys as `json.dumps` writes them: strings quoted, numbers, booleans and `None`
/// turned into strings.
fn write_json_key(out: &mut String, key: &Value, opts: &JsonOptions) -> Result<(), Error> {
    match key.kind() {
        ValueKind::String => write_json_str(out, key.as_str().unwrap_or_default(), opts),
        ValueKind::Number | ValueKind::Bool | ValueKind::None => {
            let mut s = String::new();
            write_json(&mut s, key, opts, 0)?;
            write_json_str(out, &s, opts);
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: keys must be str, int, float, bool or None",
            ));
        }
    }
    Ok(())
}

/// A JSON string as Python writes it (lowercase `\u` escapes).
fn write_json_str(out: &mut String, s: &str, opts: &JsonOptions) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c if opts.ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use minijinja::value::Serde;

    use super::*;

    fn float(f: f64) -> String {
        let mut s = String::new();
        write_float(&mut s, f, false);
        s
    }

    #[test]
    fn floats_print_like_python_repr() {
        assert_eq!(float(1.0), "1.0");
        assert_eq!(float(-0.0), "-0.0");
        assert_eq!(float(0.1), "0.1");
        assert_eq!(float(2.5), "2.5");
        assert_eq!(float(1e15), "1000000000000000.0");
        assert_eq!(float(1e16), "1e+16");
        assert_eq!(float(1.5e-5), "1.5e-05");
        assert_eq!(float(0.0001), "0.0001");
        assert_eq!(float(123_456_789.125), "123456789.125");
        assert_eq!(float(1.7976931348623157e308), "1.7976931348623157e+308");
        assert_eq!(float(f64::INFINITY), "inf");
    }

    fn json(v: serde_json::Value, opts: &JsonOptions) -> String {
        let mut s = String::new();
        write_json(&mut s, &Value::from(Serde(&v)), opts, 0).unwrap();
        s
    }

    #[test]
    fn json_matches_python_dumps() {
        let v = serde_json::json!({"b": [1, 2.0, null, true], "a": "é\"\n\u{1}", "c": {}});
        assert_eq!(
            json(v.clone(), &JsonOptions::default()),
            r#"{"b": [1, 2.0, null, true], "a": "é\"\n\u0001", "c": {}}"#
        );
        let opts = JsonOptions {
            indent: Some("  ".to_owned()),
            item_sep: ",".to_owned(),
            ..JsonOptions::default()
        };
        assert_eq!(
            json(serde_json::json!({"a": [1], "b": []}), &opts),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": []\n}"
        );
        let opts = JsonOptions {
            ensure_ascii: true,
            sort_keys: true,
            ..JsonOptions::default()
        };
        assert_eq!(
            json(serde_json::json!({"z": "é😀", "a": 1}), &opts),
            r#"{"a": 1, "z": "\u00e9\ud83d\ude00"}"#
        );
    }

    #[test]
    fn str_matches_python_str() {
        let v = Value::from(Serde(
            serde_json::json!({"a": [1, null, true, 1.5], "b'": "it's"}),
        ));
        assert_eq!(
            python_str(&v).unwrap(),
            r#"{'a': [1, None, True, 1.5], "b'": "it's"}"#
        );
        assert_eq!(python_str(&Value::from(())).unwrap(), "None");
        assert_eq!(python_str(&Value::from(false)).unwrap(), "False");
        assert_eq!(python_str(&Value::from("x\ny")).unwrap(), "x\ny");
        let v = Value::from(Serde(serde_json::json!(["a'\"\\\n\u{7f}\u{a0}é"])));
        assert_eq!(python_str(&v).unwrap(), r#"['a\'"\\\n\x7f\xa0é']"#);
    }
}
