//! PNG plots of autoscaled runs over the day: replicas per role, and TTFT and ITL at the SLO's
//! percentile per interval, one line per scaler (the font is the one `load::plot` registers).

use std::path::Path;

use plotters::prelude::*;

const FAMILY: &str = "sans-serif";

/// One line: a label and its (hour of the day, value) points.
pub(crate) type Line = (String, Vec<(f64, f64)>);

/// One panel: title, y-axis name, lines, an optional horizontal objective, a y-axis cap.
pub(crate) struct Panel<'a> {
    pub(crate) title: &'a str,
    pub(crate) y_desc: &'a str,
    pub(crate) lines: &'a [Line],
    pub(crate) objective: Option<f64>,
    pub(crate) y_cap: Option<f64>,
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    p: &Panel<'_>,
    hours: f64,
) -> Result<(), String> {
    let top = p
        .lines
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|q| q.1))
        .chain(p.objective)
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let top = p.y_cap.map_or(top, |c| top.min(c));
    let y_max = if top > 0.0 { top * 1.08 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(p.title, (FAMILY, 22))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..hours, 0.0..y_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("hour of the day")
        .y_desc(p.y_desc)
        .label_style((FAMILY, 14))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (label, points)) in p.lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let clipped = points.iter().map(|&(x, y)| (x, y.min(y_max)));
        chart
            .draw_series(LineSeries::new(clipped, color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    if let Some(v) = p.objective {
        chart
            .draw_series(LineSeries::new(
                [(0.0, v), (hours, v)],
                BLACK.mix(0.6).stroke_width(1),
            ))
            .map_err(|e| e.to_string())?
            .label("objective")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.6)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Draws `panels` stacked vertically into `path` over `hours` hours.
pub(crate) fn draw(path: &Path, panels: &[Panel<'_>], hours: f64) -> Result<(), String> {
    let height = 420 * u32::try_from(panels.len()).unwrap_or(1).max(1);
    let root = BitMapBackend::new(path, (1500, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    for (area, panel) in areas.iter().zip(panels) {
        draw_panel(area, panel, hours)?;
    }
    root.present().map_err(|e| e.to_string())
}
