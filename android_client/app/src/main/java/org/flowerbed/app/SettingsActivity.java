package org.flowerbed.app;

import android.app.Activity;
import android.content.Intent;
import android.os.Build;
import android.os.Bundle;
import android.text.InputType;
import android.widget.Button;
import android.widget.CheckBox;
import android.widget.EditText;
import android.widget.LinearLayout;
import android.widget.ScrollView;
import android.widget.TextView;
import java.io.File;

/** The one screen: gateway URL, token, training conditions, start and stop. */
public final class SettingsActivity extends Activity {
  private EditText url;
  private EditText token;
  private CheckBox charging;
  private CheckBox unmetered;
  private EditText sampleShape;
  private EditText maxBatch;
  private TextView status;

  @Override
  protected void onCreate(Bundle saved) {
    super.onCreate(saved);
    if (Build.VERSION.SDK_INT >= 33) {
      requestPermissions(new String[] {"android.permission.POST_NOTIFICATIONS"}, 1);
    }
    AppSettings s = AppSettings.load(this);
    LinearLayout col = new LinearLayout(this);
    col.setOrientation(LinearLayout.VERTICAL);
    int pad = (int) (16 * getResources().getDisplayMetrics().density);
    col.setPadding(pad, pad, pad, pad);

    url = field(col, "Gateway URL", s.gatewayUrl, InputType.TYPE_TEXT_VARIATION_URI);
    token = field(col, "Token", s.token, InputType.TYPE_TEXT_VARIATION_VISIBLE_PASSWORD);
    charging = check(col, "Train only while charging", s.requireCharging);
    unmetered = check(col, "Train only on unmetered Wi-Fi", s.requireUnmeteredWifi);
    sampleShape = field(col, "Sample shape of the .pte (e.g. 1,8,8)", s.sampleShape, 0);
    maxBatch =
        field(
            col,
            "Max batch size of the .pte",
            Integer.toString(s.maxBatchSize),
            InputType.TYPE_CLASS_NUMBER);

    Button start = new Button(this);
    start.setText("Save and start");
    start.setOnClickListener(v -> startTraining());
    col.addView(start);
    Button stop = new Button(this);
    stop.setText("Stop");
    stop.setOnClickListener(v -> stopService(new Intent(this, TrainingService.class)));
    col.addView(stop);

    TextView files = new TextView(this);
    File dir = getExternalFilesDir(null);
    files.setText(
        "Files: "
            + new File(dir, TrainingService.MODEL_FILE)
            + "\n       "
            + new File(dir, TrainingService.DATA_FILE));
    col.addView(files);
    status = new TextView(this);
    col.addView(status);

    ScrollView scroll = new ScrollView(this);
    scroll.addView(col);
    setContentView(scroll);
  }

  @Override
  protected void onResume() {
    super.onResume();
    status.setText("Last: " + AppSettings.lastLine(this));
  }

  private void startTraining() {
    AppSettings s = new AppSettings();
    s.gatewayUrl = url.getText().toString().trim();
    s.token = token.getText().toString().trim();
    s.requireCharging = charging.isChecked();
    s.requireUnmeteredWifi = unmetered.isChecked();
    s.sampleShape = sampleShape.getText().toString().trim();
    try {
      s.maxBatchSize = Integer.parseInt(maxBatch.getText().toString().trim());
      s.sampleShapeDims();
      if (s.maxBatchSize < 1) {
        throw new IllegalArgumentException("max batch size must be >= 1");
      }
    } catch (IllegalArgumentException e) {
      status.setText("Not saved: " + e.getMessage());
      return;
    }
    s.save(this);
    // A running service keeps the settings it started with: restart it with the new ones.
    stopService(new Intent(this, TrainingService.class));
    startForegroundService(new Intent(this, TrainingService.class));
    status.setText("Started; the notification shows each task.");
  }

  private EditText field(LinearLayout col, String label, String value, int variation) {
    TextView l = new TextView(this);
    l.setText(label);
    col.addView(l);
    EditText e = new EditText(this);
    e.setInputType(
        variation == InputType.TYPE_CLASS_NUMBER
            ? variation
            : InputType.TYPE_CLASS_TEXT | variation);
    e.setText(value);
    col.addView(e);
    return e;
  }

  private CheckBox check(LinearLayout col, String label, boolean value) {
    CheckBox c = new CheckBox(this);
    c.setText(label);
    c.setChecked(value);
    col.addView(c);
    return c;
  }
}
