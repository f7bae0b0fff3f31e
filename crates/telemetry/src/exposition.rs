//! The Prometheus text exposition format (version 0.0.4).

use std::fmt::Write as _;

use crate::histogram::HistogramSnapshot;

/// A metric family's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic.
    Counter,
    /// Goes up and down.
    Gauge,
    /// Buckets, count and sum.
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Escapes a label value: backslash, double quote and newline.
pub fn escape_label_value(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return std::borrow::Cow::Borrowed(v);
    }
    let mut out = String::with_capacity(v.len() + 2);
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A text exposition being written. Write each family's [`Exposition::family`] header once,
/// then its samples.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// An empty exposition.
    pub fn new() -> Self {
        Self::default()
    }

    /// `# HELP` and `# TYPE` lines for a family.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut Self {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(
            self.out,
            "# HELP {name} {help}\n# TYPE {name} {}",
            kind.as_str()
        );
        self
    }

    /// One sample line.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.out.push_str(name);
        self.labels(labels, None);
        let _ = writeln!(self.out, " {}", format_value(value));
        self
    }

    /// A family header and a single sample.
    pub fn single(
        &mut self,
        name: &str,
        kind: Kind,
        help: &str,
        labels: &[(&str, &str)],
        value: f64,
    ) -> &mut Self {
        self.family(name, kind, help).sample(name, labels, value)
    }

    /// A histogram's bucket, count and sum lines (its header written separately).
    pub fn histogram(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        h: &HistogramSnapshot,
    ) -> &mut Self {
        for (bound, n) in &h.buckets {
            let le = format_value(*bound);
            let _ = write!(self.out, "{name}_bucket");
            self.labels(labels, Some(&le));
            let _ = writeln!(self.out, " {n}");
        }
        let _ = write!(self.out, "{name}_bucket");
        self.labels(labels, Some("+Inf"));
        let _ = writeln!(self.out, " {}", h.count);
        let _ = write!(self.out, "{name}_sum");
        self.labels(labels, None);
        let _ = writeln!(self.out, " {}", format_value(h.sum));
        let _ = write!(self.out, "{name}_count");
        self.labels(labels, None);
        let _ = writeln!(self.out, " {}", h.count);
        self
    }

    /// The text.
    pub fn finish(self) -> String {
        self.out
    }

    fn labels(&mut self, labels: &[(&str, &str)], le: Option<&str>) {
        if labels.is_empty() && le.is_none() {
            return;
        }
        self.out.push('{');
        let mut first = true;
        for (k, v) in labels {
            if !first {
                self.out.push(',');
            }
            first = false;
            let _ = write!(self.out, "{k}=\"{}\"", escape_label_value(v));
        }
        if let Some(le) = le {
            if !first {
                self.out.push(',');
            }
            let _ = write!(self.out, "le=\"{le}\"");
        }
        self.out.push('}');
    }
}

/// Prometheus float syntax: `NaN`, `+Inf`, `-Inf`, else Rust's shortest round-trip form.
fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v == f64::INFINITY {
        "+Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Histogram;

    #[test]
    fn writes_families_samples_and_histograms() {
        let h = Histogram::new(&[0.5, 1.0]);
        h.observe(0.25);
        h.observe(3.0);
        let mut e = Exposition::new();
        e.single("up", Kind::Gauge, "Whether it is up.", &[], 1.0);
        e.family("req_total", Kind::Counter, "Requests.").sample(
            "req_total",
            &[("model", "a\"b\\c\nd")],
            3.0,
        );
        e.family("lat_seconds", Kind::Histogram, "Latency.")
            .histogram("lat_seconds", &[("pool", "p")], &h.snapshot());
        let text = e.finish();
        assert_eq!(
            text,
            "# HELP up Whether it is up.\n# TYPE up gauge\nup 1\n\
             # HELP req_total Requests.\n# TYPE req_total counter\n\
             req_total{model=\"a\\\"b\\\\c\\nd\"} 3\n\
             # HELP lat_seconds Latency.\n# TYPE lat_seconds histogram\n\
             lat_seconds_bucket{pool=\"p\",le=\"0.5\"} 1\n\
             lat_seconds_bucket{pool=\"p\",le=\"1\"} 1\n\
             lat_seconds_bucket{pool=\"p\",le=\"+Inf\"} 2\n\
             lat_seconds_sum{pool=\"p\"} 3.25\n\
             lat_seconds_count{pool=\"p\"} 2\n"
        );
    }

    #[test]
    fn special_values() {
        assert_eq!(format_value(f64::NAN), "NaN");
        assert_eq!(format_value(f64::INFINITY), "+Inf");
        assert_eq!(format_value(f64::NEG_INFINITY), "-Inf");
        assert_eq!(format_value(0.1), "0.1");
    }
}
