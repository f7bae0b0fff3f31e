//! `strftime_now(format)`, the template global Hugging Face provides (Llama 3 templates print
//! today's date with it). Time is UTC: servers run with `TZ=UTC`, and both the engine simulator
//! and the EPP must print the same date.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A UTC calendar time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DateTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday … 6 = Sunday
    weekday: u32,
    /// 1..=366
    yday: u32,
}

impl DateTime {
    /// The UTC time `secs` seconds after the Unix epoch.
    pub(crate) fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        let jan1 = days_from_civil(year, 1, 1);
        Self {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem / 60 % 60) as u32,
            second: (rem % 60) as u32,
            // 1970-01-01 was a Thursday (3).
            weekday: (days + 3).rem_euclid(7) as u32,
            yday: (days - jan1 + 1) as u32,
        }
    }

    /// Now, in UTC.
    pub(crate) fn now() -> Self {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Self::from_unix(secs)
    }

    /// C `strftime` for the common directives (`%Y %y %m %d %e %H %I %M %S %p %B %b %h %A %a %j
    /// %u %w %F %T %D %%`), with glibc's `%-d`-style unpadded forms. Unknown directives are copied.
    pub(crate) fn format(&self, fmt: &str) -> String {
        let mut out = String::with_capacity(fmt.len() + 16);
        let mut chars = fmt.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let mut spec = chars.next();
            let pad = if spec == Some('-') {
                spec = chars.next();
                false
            } else {
                true
            };
            let num = |out: &mut String, v: i64, width: usize| {
                let _ = if pad {
                    write!(out, "{v:0width$}")
                } else {
                    write!(out, "{v}")
                };
            };
            let month_name = MONTHS
                .get(self.month.saturating_sub(1) as usize)
                .copied()
                .unwrap_or("");
            let day_name = WEEKDAYS.get(self.weekday as usize).copied().unwrap_or("");
            let hour12 = match self.hour % 12 {
                0 => 12,
                h => h,
            };
            match spec {
                Some('Y') => {
                    let _ = write!(out, "{}", self.year);
                }
                Some('y') => num(&mut out, self.year.rem_euclid(100), 2),
                Some('m') => num(&mut out, i64::from(self.month), 2),
                Some('d') => num(&mut out, i64::from(self.day), 2),
                Some('e') => {
                    let _ = if pad {
                        write!(out, "{:2}", self.day)
                    } else {
                        write!(out, "{}", self.day)
                    };
                }
                Some('H') => num(&mut out, i64::from(self.hour), 2),
                Some('I') => num(&mut out, i64::from(hour12), 2),
                Some('M') => num(&mut out, i64::from(self.minute), 2),
                Some('S') => num(&mut out, i64::from(self.second), 2),
                Some('j') => num(&mut out, i64::from(self.yday), 3),
                Some('p') => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                Some('B') => out.push_str(month_name),
                Some('b') | Some('h') => out.push_str(month_name.get(..3).unwrap_or("")),
                Some('A') => out.push_str(day_name),
                Some('a') => out.push_str(day_name.get(..3).unwrap_or("")),
                Some('u') => {
                    let _ = write!(out, "{}", self.weekday + 1);
                }
                Some('w') => {
                    let _ = write!(out, "{}", (self.weekday + 1) % 7);
                }
                Some('F') => {
                    let _ = write!(out, "{}-{:02}-{:02}", self.year, self.month, self.day);
                }
                Some('T') => {
                    let _ = write!(
                        out,
                        "{:02}:{:02}:{:02}",
                        self.hour, self.minute, self.second
                    );
                }
                Some('D') => {
                    let _ = write!(
                        out,
                        "{:02}/{:02}/{:02}",
                        self.month,
                        self.day,
                        self.year.rem_euclid(100)
                    );
                }
                Some('%') => out.push('%'),
                Some(other) => {
                    out.push('%');
                    if !pad {
                        out.push('-');
                    }
                    out.push(other);
                }
                None => out.push('%'),
            }
        }
        out
    }
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so that leap days fall at the end of each 400-year era.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of year from March 1st, 0..=365
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month, day) to days since 1970-01-01; the inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = year - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        let t = DateTime::from_unix(0);
        assert_eq!(
            t.format("%Y-%m-%d %H:%M:%S %A %a %B %b %j"),
            "1970-01-01 00:00:00 Thursday Thu January Jan 001"
        );
        // 2024-02-29T13:05:09Z, a leap day (Thursday).
        let t = DateTime::from_unix(1_709_211_909);
        assert_eq!(t.format("%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            t.format("%-d %B %Y, %I:%M %p, %j, %u %w, %e"),
            "29 February 2024, 01:05 PM, 060, 4 4, 29"
        );
        assert_eq!(
            t.format("%F %T %D 100%% %Q"),
            "2024-02-29 13:05:09 02/29/24 100% %Q"
        );
        // 2000-12-31T23:59:59Z: day 366 of a leap year, a Sunday.
        let t = DateTime::from_unix(978_307_199);
        assert_eq!(t.format("%Y %j %A %y"), "2000 366 Sunday 00");
    }

    #[test]
    fn civil_round_trips() {
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
