//! PNG plots of a sweep with `plotters`: TTFT p50 and p95 against load, and output throughput
//! against load, one line per run label. Text is drawn with a TrueType font read at run time
//! (DejaVu Sans by default, from Debian's `fonts-dejavu-core`).

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use workload::Summary;

use super::error::{LoadError, Result};

/// Where Debian's `fonts-dejavu-core` puts DejaVu Sans.
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

const FAMILY: &str = "sans-serif";

static FONT: OnceLock<()> = OnceLock::new();

/// Loads the font plots are written in; call once before plotting.
pub fn register_font(path: &Path) -> Result<()> {
    if FONT.get().is_some() {
        return Ok(());
    }
    let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
        context: format!(
            "reading the plot font {} (install fonts-dejavu-core or pass --font)",
            path.display()
        ),
        source,
    })?;
    // plotters keeps registered fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font(FAMILY, FontStyle::Normal, bytes).map_err(|_| {
        LoadError::Plot {
            path: path.display().to_string(),
            reason: "not a TrueType font".into(),
        }
    })?;
    let _ = FONT.set(());
    Ok(())
}

/// One line: a run label and its (load, value) points, by load.
type Line = (String, Vec<(f64, f64)>);

fn lines(summaries: &[Summary], value: impl Fn(&Summary) -> Option<f64>) -> Vec<Line> {
    let mut out: Vec<Line> = Vec::new();
    for s in summaries {
        let Some(v) = value(s) else { continue };
        let point = (s.load.unwrap_or(0.0), v);
        match out.iter_mut().find(|(run, _)| *run == s.run) {
            Some((_, points)) => points.push(point),
            None => out.push((s.run.clone(), vec![point])),
        }
    }
    for (_, points) in &mut out {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

fn plot_err(path: &Path) -> impl Fn(String) -> LoadError + '_ {
    move |reason| LoadError::Plot {
        path: path.display().to_string(),
        reason,
    }
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    y_desc: &str,
    lines: &[Line],
) -> std::result::Result<(), String> {
    let xs = lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let (x_min, x_max) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let (x_min, x_max) = if x_min.is_finite() {
        (x_min, x_max)
    } else {
        (0.0, 1.0)
    };
    let pad = ((x_max - x_min) * 0.05).max(0.5);
    let y_max = lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(0.0f64, f64::max);
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FAMILY, 24))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d((x_min - pad)..(x_max + pad), 0.0..y_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("load")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x}"))
        .label_style((FAMILY, 15))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (run, points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(run.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FAMILY, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// TTFT p50 (left) and p95 (right) against load.
pub fn ttft(summaries: &[Summary], path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    let draw = || -> std::result::Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let halves = root.split_evenly((1, 2));
        let (Some(left), Some(right)) = (halves.first(), halves.get(1)) else {
            return Err("no drawing area".into());
        };
        panel(left, "TTFT p50", "ms", &lines(summaries, |s| s.ttft_ms.p50))?;
        panel(
            right,
            "TTFT p95",
            "ms",
            &lines(summaries, |s| s.ttft_ms.p95),
        )?;
        root.present().map_err(|e| e.to_string())
    };
    draw().map_err(plot_err(path))
}

/// Output tokens per second (left) and goodput in requests per second (right) against load.
pub fn throughput(summaries: &[Summary], path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (1400, 560)).into_drawing_area();
    let draw = || -> std::result::Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let halves = root.split_evenly((1, 2));
        let (Some(left), Some(right)) = (halves.first(), halves.get(1)) else {
            return Err("no drawing area".into());
        };
        panel(
            left,
            "Output throughput",
            "tokens/s",
            &lines(summaries, |s| Some(s.output_tokens_per_s)),
        )?;
        panel(
            right,
            "Goodput (TTFT and TPOT within the SLO)",
            "requests/s",
            &lines(summaries, |s| Some(s.goodput_per_s)),
        )?;
        root.present().map_err(|e| e.to_string())
    };
    draw().map_err(plot_err(path))
}
