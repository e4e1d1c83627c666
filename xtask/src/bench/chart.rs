//! PNG charts of benchmark results (plotters, with a system TrueType font).

use std::path::Path;

use anyhow::{Context as _, Result, anyhow};
use plotters::prelude::*;

const FONT_FILES: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

fn register_font() -> Result<()> {
    let path = FONT_FILES
        .iter()
        .find(|path| Path::new(path).exists())
        .context("no TrueType font found (Debian package fonts-dejavu-core)")?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(path)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("invalid font {path}"))
}

/// One panel of bars: labels with values, a reference line at `reference` (e.g. 1.0×).
pub struct BarPanel<'a> {
    pub title: &'a str,
    pub y_label: &'a str,
    pub bars: Vec<(String, f64)>,
    pub reference: Option<f64>,
}

/// Draws the panels side by side into `path`.
pub fn bars(path: &Path, caption: &str, panels: &[BarPanel<'_>]) -> Result<()> {
    register_font()?;
    // Wide enough for each bar's label on its own (about 60 pixels at the labels' size).
    let panel_width = |panel: &BarPanel<'_>| {
        u32::try_from(panel.bars.len() * 60 + 100)
            .unwrap_or(u32::MAX)
            .max(700)
    };
    let widest = panels.iter().map(panel_width).max().unwrap_or(700);
    let width = widest * u32::try_from(panels.len()).unwrap_or(1);
    let root = BitMapBackend::new(path, (width, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(caption, ("sans-serif", 22))?;
    let areas = root.split_evenly((1, panels.len()));
    for (area, panel) in areas.iter().zip(panels) {
        let top = panel
            .bars
            .iter()
            .map(|(_, value)| *value)
            .chain(panel.reference)
            .fold(0.0_f64, f64::max)
            * 1.2;
        let count = panel.bars.len();
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(70)
            .y_label_area_size(60)
            .build_cartesian_2d(
                (0..count.saturating_sub(1)).into_segmented(),
                0.0..top.max(0.001),
            )?;
        let labels: Vec<String> = panel.bars.iter().map(|(label, _)| label.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(panel.y_label)
            .x_labels(count)
            .x_label_formatter(&|segment| match segment {
                SegmentValue::CenterOf(index) => labels.get(*index).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .label_style(("sans-serif", 11))
            .draw()?;
        chart.draw_series(panel.bars.iter().enumerate().map(|(index, (_, value))| {
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(index), 0.0),
                    (SegmentValue::Exact(index + 1), *value),
                ],
                BLUE.mix(0.6).filled(),
            );
            bar.set_margin(0, 0, 12, 12);
            bar
        }))?;
        chart.draw_series(panel.bars.iter().enumerate().map(|(index, (_, value))| {
            Text::new(
                format!("{value:.2}"),
                (SegmentValue::CenterOf(index), *value),
                ("sans-serif", 13),
            )
        }))?;
        if let Some(reference) = panel.reference {
            chart.draw_series(LineSeries::new(
                [
                    (SegmentValue::Exact(0), reference),
                    (SegmentValue::Exact(count), reference),
                ],
                RED.stroke_width(2),
            ))?;
        }
    }
    root.present().context("write chart")?;
    Ok(())
}
